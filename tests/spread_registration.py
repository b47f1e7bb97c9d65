"""Registers the test objective when imported: the module a config names in `objectives.imports`. Kept apart from
the objective's settings class (tests/spread_objective.py), so that unpickling a config, which imports that class's
module, registers nothing: only `objectives.imports` does."""

from spread_objective import register_spread

register_spread()
