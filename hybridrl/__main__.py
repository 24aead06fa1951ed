from .cli import main

if __name__ == "__main__":  # not when a spawned reward worker imports this module
    main()
