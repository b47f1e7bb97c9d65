"""Programs that build the demo data sets, kept out of the library: `tools.demo_corpus` (the LibreOffice Help
corpus, `scripts/build_demo_corpus.sh`) and `tools.demo_tasks` (the fine-tuning tasks, `marge prepare-tasks`).
They import the library `marge`; neither the library nor the stages import them."""
