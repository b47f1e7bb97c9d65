"""The program that builds the demo corpus, run from a checkout: `python -m tools.demo_corpus` (the LibreOffice
Help corpus, `scripts/build_demo_corpus.sh`). It imports the library `marge`; neither the library nor `services`
imports it, and the wheel does not ship it. (The demo fine-tuning tasks are built by `marge prepare-tasks`,
`services.prepare.demo_tasks`.)"""
