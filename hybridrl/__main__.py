from hybridrl.run.cli import main

if __name__ == "__main__":  # not when a spawned process (vLLM's engine, a reward worker) imports this
    main()
