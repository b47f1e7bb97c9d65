"""`python -m services.cli ...` is `marge ...` without the installed script (the tests run it this way)."""

from services.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
