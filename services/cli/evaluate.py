"""`marge eval retrieval | translate | finetuned` and `marge translate`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def layer_arg(text: str) -> int | str:
    if text == "g":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer must be a layer number or g, got {text!r}") from None


def model_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--checkpoint", default=None, help="a checkpoint folder (`checkpoint` in marge pretrain's summary)")
    q.add_argument("--snapshot", default=None, help="a relevance-encoder snapshot folder (needs --corpus)")
    q.add_argument("--config", default=None, help="pipeline config, for --random-init without a checkpoint")
    q.add_argument("--corpus", default=None, help="prepared corpus whose tokenizer to use")
    q.add_argument("--random-init", action="store_true", help="an untrained model of the same config")
    q.add_argument("--seed", type=int, default=0)


def generation_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--beam", type=int, default=6, help="beam size (paper: 6)")
    q.add_argument("--no-repeat-ngram", type=int, default=8, help="block repeated n-grams (paper: 8)")
    q.add_argument("--max-len-a", type=float, default=1.5)
    q.add_argument("--max-len-b", type=int, default=10)


def eval_model(args: argparse.Namespace):
    """(model, tokenizer, label) for --checkpoint / --snapshot / --random-init / --config (`load_eval_model`)."""
    from marge.eval.evaluation import load_eval_model

    model_config, corpus = None, args.corpus
    if args.config and not args.snapshot and not args.checkpoint:  # the run config only says the model's shape
        from services.driver.config import load_config

        cfg = load_config(args.config)
        model_config, corpus = cfg.model_config, args.corpus or cfg.data.corpus
    return load_eval_model(args.checkpoint, args.snapshot, corpus, args.random_init, args.seed, model_config)


def generation_config(args: argparse.Namespace):
    from marge.model.generate import GenerationConfig

    return GenerationConfig(beam=args.beam, no_repeat_ngram=args.no_repeat_ngram, max_len_a=args.max_len_a,
                            max_len_b=args.max_len_b)


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="evaluation: retrieval P@1, translation BLEU/chrF, fine-tuned models")
    eval_sub = p.add_subparsers(dest="eval_command", required=True)
    q = eval_sub.add_parser("retrieval", help="cross-lingual sentence retrieval P@1 (paper §4.1)")
    q.add_argument("--pairs", required=True, help="TSV: src_lang, src_text, tgt_lang, tgt_text")
    model_args(q)
    q.add_argument("--layer", type=layer_arg, default=None,
                   help="encoder layer to mean-pool (default 5, the paper's), or g: the relevance vectors the index searches")
    q.add_argument("--margin", action="store_true", help="ratio-margin scoring instead of cosine")
    q.add_argument("--tfidf", action="store_true", help="evaluate the char n-gram TF-IDF baseline instead of a model")
    q.add_argument("--compare", action="store_true", help="trained vs random init vs TF-IDF in one run")
    q.add_argument("--json", action="store_true", help="one JSON object mapping 'src->tgt' to P@1")
    q.set_defaults(func=cmd_eval_retrieval)
    q = eval_sub.add_parser("translate", help="zero-shot document translation, scored with sacrebleu")
    model_args(q)
    q.add_argument("--docs", default=None, help="documents JSONL (pairs are documents of one group)")
    q.add_argument("--pairs", default=None, help="or a pairs TSV")
    q.add_argument("--src", required=True)
    q.add_argument("--tgt", required=True)
    q.add_argument("--limit", type=int, default=None, help="score only the first N pairs")
    q.add_argument("--out", default=None, help="write the translations here")
    q.add_argument("--json", action="store_true")
    generation_args(q)
    q.set_defaults(func=cmd_eval_translate)

    q = eval_sub.add_parser("finetuned", help="a fine-tuned model on a task file: accuracy and macro-F1, or BLEU and chrF")
    q.add_argument("--model", required=True, help="a `marge finetune` output folder (or a pre-training checkpoint: "
                                                  "zero-shot generation)")
    q.add_argument("--data", required=True, help="task JSONL with labels / targets (the format `marge finetune` reads)")
    q.add_argument("--limit", type=int, default=None, help="evaluate only the first N examples")
    q.add_argument("--out", default=None, help="generation: write the outputs here, one per line")
    q.add_argument("--json", action="store_true", help="only the JSON result (always printed last)")
    generation_args(q)
    q.set_defaults(func=cmd_eval_finetuned)


def cmd_eval_retrieval(args: argparse.Namespace) -> int:
    from marge.eval.evaluation import evaluate_model, evaluate_tfidf, mean_score, read_pairs

    pairs = read_pairs(Path(args.pairs))
    systems: dict[str, dict[str, float]] = {}
    if args.compare:
        if args.checkpoint:
            args.random_init = False
            model, tok, _ = eval_model(args)
            pairs = read_pairs(Path(args.pairs), tok.languages)  # the directions the model knows
            systems["trained"] = evaluate_model(model, tok, pairs, args.layer, args.margin)
        args.random_init = True
        model, tok, _ = eval_model(args)
        pairs = read_pairs(Path(args.pairs), tok.languages)
        systems["random_init"] = evaluate_model(model, tok, pairs, args.layer, args.margin)
        systems["tfidf"] = evaluate_tfidf(pairs, args.margin)
        result: dict = systems
    elif args.tfidf:
        result = evaluate_tfidf(pairs, args.margin)
        systems["tfidf"] = result
    else:
        model, tok, label = eval_model(args)
        result = evaluate_model(model, tok, read_pairs(Path(args.pairs), tok.languages), args.layer, args.margin)
        systems[label] = result
    if args.json:
        print(json.dumps(result))
    else:
        keys = sorted({k for r in systems.values() for k in r})
        print(f"{'pair':<10}" + "".join(f"{name:>14}" for name in systems))
        for key in keys:
            print(f"{key:<10}" + "".join(f"{systems[name].get(key, float('nan')):>14.3f}" for name in systems))
        print(f"{'mean':<10}" + "".join(f"{mean_score(r):>14.3f}" for r in systems.values()))
    return 0


def cmd_eval_translate(args: argparse.Namespace) -> int:
    from marge.eval.evaluation import read_document_pairs, read_pairs
    from marge.model.finetuned import generation_scores
    from marge.model.generate import translate
    from marge.util.progress import track
    from services.finetune.run import refuse_classifier

    refuse_classifier(args.checkpoint)
    model, tok, _ = eval_model(args)
    if args.docs:
        pairs = read_document_pairs(Path(args.docs), args.src, args.tgt, args.limit)
    else:
        sets = [p for p in read_pairs(Path(args.pairs)) if (p.src_lang, p.tgt_lang) == (args.src, args.tgt)]
        if not sets:
            raise ValueError(f"{args.pairs}: no {args.src}->{args.tgt} pairs")
        pairs = list(zip(sets[0].sources, sets[0].targets))[: args.limit or None]
    cfg = generation_config(args)
    hypotheses = [" ".join(translate(model, tok, " ".join(src.split()), args.tgt, cfg).split())
                  for src, _ in track(pairs, f"translating {args.src}->{args.tgt}", unit="doc")]
    references = [" ".join(ref.split()) for _, ref in pairs]
    scores = generation_scores(hypotheses, references, args.tgt)
    result = {"src": args.src, "tgt": args.tgt, "documents": len(pairs), "bleu": scores["bleu"],
              "chrf": scores["chrf"], "beam": cfg.beam, "no_repeat_ngram": cfg.no_repeat_ngram}
    if args.out:
        Path(args.out).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    print(json.dumps(result) if args.json else f"{args.src}->{args.tgt}: BLEU {scores['bleu']:.2f}  "
          f"chrF {scores['chrf']:.2f} ({len(pairs)} documents)")
    return 0


def cmd_eval_finetuned(args: argparse.Namespace) -> int:
    from marge.contracts.tasks import read_task_file
    from marge.model.finetuned import evaluate, load
    from marge.util.progress import Progress

    model = load(args.model)
    task = model.task or "generation"  # a pre-training checkpoint generates zero-shot
    examples = read_task_file(args.data, task, model.tokenizer.languages, model.labels)[: args.limit or None]
    with Progress("evaluating", len(examples), unit="example") as bar:
        result = evaluate(model, examples, args.beam, args.no_repeat_ngram, progress=bar.update)
    hypotheses = result.pop("hypotheses", None)
    if args.out and hypotheses is not None:
        Path(args.out).write_text("".join(" ".join(h.split()) + "\n" for h in hypotheses), encoding="utf-8")
    result = {"model": str(args.model), "data": str(args.data), "task": task, **result}
    if task == "generation":
        result.update(beam=args.beam, no_repeat_ngram=args.no_repeat_ngram)
    if not args.json:
        names = ("accuracy", "macro_f1") if task == "classification" else ("bleu", "chrf")
        for group, scores in [("all", result), *result["by_language"].items()]:
            print(f"{group:<10}" + "".join(f"  {n} {scores[n]:.4f}" for n in names) + f"  ({scores['examples']} examples)",
                  file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0


def add_translate(sub) -> None:
    p = sub.add_parser("translate", help="translate documents (one per stdin line) into --tgt-lang")
    model_args(p)
    p.add_argument("--tgt-lang", required=True)
    generation_args(p)
    p.set_defaults(func=cmd_translate)


def cmd_translate(args: argparse.Namespace) -> int:
    from marge.model.generate import translate
    from services.finetune.run import refuse_classifier

    args.snapshot = None  # a snapshot holds the relevance encoder alone: nothing to generate with
    refuse_classifier(args.checkpoint)
    model, tok, _ = eval_model(args)
    if not hasattr(model, "decode"):
        raise ValueError(f"{args.checkpoint or args.config} holds a {type(model).__name__} model, an encoder that cannot "
                         "generate: translate with a MARGE or BART checkpoint (`marge eval retrieval` takes this one)")
    cfg = generation_config(args)
    for line in sys.stdin:
        if line.strip():
            print(translate(model, tok, line.rstrip("\n"), args.tgt_lang, cfg), flush=True)
    return 0
