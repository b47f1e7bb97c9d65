"""The trainer stage of the MARGE pipeline."""
