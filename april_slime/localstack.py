"""``python -m april_slime.localstack``: the workbench's local real stack (april_slime.workbench.localstack)."""

if __name__ == "__main__":
    import sys

    from april_slime.workbench.localstack import main

    sys.exit(main())
