"""`python -m experiments.copy_race`: the copy race (experiments/copy_race/README.md), run from the checkout's root."""

from experiments.copy_race.copy_race import main

if __name__ == "__main__":
    main()
