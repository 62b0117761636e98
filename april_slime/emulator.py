"""``python -m april_slime.emulator``: the workbench's SGLang emulator (april_slime.workbench.emulator)."""

if __name__ == "__main__":
    import sys

    from april_slime.workbench.emulator.__main__ import main

    sys.exit(main(prog="python -m april_slime.emulator"))
