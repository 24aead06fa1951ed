from .cli import main

if __name__ == "__main__":  # vLLM's engine process (rollout.mode=outofprocess) is spawned: it re-imports this
    main()
