"""The `marge` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from marge.utils import setup_logging
from services.driver.lock import RunLocked
from services.retrieval.settings import ServeSettings

SERVE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServeSettings)}

log = logging.getLogger("marge")


def cmd_prepare(args: argparse.Namespace) -> int:
    from marge.prepare import PrepareOptions, prepare

    opts = PrepareOptions(
        inputs=args.inputs, out=args.out, tokenizer_dir=args.tokenizer, vocab_size=args.vocab_size,
        max_chunk_tokens=args.max_chunk_tokens, document_unit=args.document_unit,
        min_document_tokens=args.min_document_tokens, docs_per_shard=args.docs_per_shard, num_shards=args.num_shards,
        heldout_permille=args.heldout_permille,
        languages=tuple(args.languages.split(",")) if args.languages else None, lid=not args.no_lid,
        lid_threshold=args.lid_threshold, max_document_chars=args.max_document_chars,
        on_bad_document="skip" if args.skip_bad_documents else "error", seed=args.seed, overwrite=args.overwrite)
    manifest = prepare(opts)
    summary = {k: manifest[k] for k in ("num_documents", "num_shards", "num_groups", "num_tokens", "languages")}
    if manifest.get("heldout"):
        summary["heldout"] = {k: manifest["heldout"][k] for k in ("groups", "documents", "pairs")}
    summary["out"] = str(args.out)
    print(json.dumps(summary))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from marge.model import build_on_meta, count_parameters, parameter_breakdown, preset

    overrides = dict(parse_override(o) for o in args.set or [])
    try:
        cfg = preset(args.preset, **overrides)
    except TypeError as e:  # an unknown field: name it with the ones there are
        from marge.model import MargeConfig

        known = sorted(f.name for f in __import__("dataclasses").fields(MargeConfig))
        raise ValueError(f"--set {', '.join(sorted(overrides))}: {e}; the fields are {known}") from None
    model = build_on_meta(cfg)
    info = {"preset": args.preset, "num_parameters": count_parameters(model),
            "parameters_by_part": parameter_breakdown(model), "config": cfg.to_dict()}
    if args.json:
        print(json.dumps(info))
    else:
        print(f"preset {args.preset}: {info['num_parameters']:,} parameters ({info['num_parameters'] / 1e6:.1f}M)")
        for part, n in info["parameters_by_part"].items():
            print(f"  {part:<14} {n:>14,}")
        for key, value in info["config"].items():
            print(f"  {key} = {value}")
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from services.driver.config import load_config
    from services.driver.pipeline import run_pipeline

    cfg = load_config(args.config, args.overrides)
    summary = run_pipeline(cfg)
    print(json.dumps(summary), flush=True)
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from services.driver.audit import audit, run_queue

    with run_queue(args.run, args.redis_url) as (cfg, queue):
        result = audit(cfg, queue)
    if not args.json:
        print(f"run {args.run}: {result['steps']} updates in the newest checkpoint; batches produced "
              f"{result['batches_produced']}, trained {result['batches_trained']}, lost {result['batches_lost']}, "
              f"trained twice {result['trained_twice']}, pending {result['batches_pending']}, dead-lettered "
              f"{result['batches_dead_lettered']} (replayed {result['batches_replayed']})", file=sys.stderr)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def cmd_queue(args: argparse.Namespace) -> int:
    from services.driver.audit import run_queue

    with run_queue(args.run, args.redis_url) as (_, queue):
        if args.queue_command == "list-dead":
            dead = queue.dead_letters()
            if args.json:
                print(json.dumps(dead))
            else:
                for d in dead:
                    where = (f"requeued into slot {d['replayed_to_slot']}" if d["replayed_to_slot"] is not None
                             else "replay requested" if d["replay_requested"] else "")
                    print(f"{d['entry']}  slot {d['slot']}  {d['batch_id']}  {d['reason']}  {where}")
                print(f"{len(dead)} dead-lettered batch(es)", file=sys.stderr)
        else:
            for entry in args.entries:
                queue.request_replay(entry)
                print(f"requeued {entry}: the batcher writes it into the next slot it writes (a running run trains "
                      "it within the queue's depth; a stopped one when it is resumed)")
    return 0


def run_config(run_dir: Path) -> dict:
    """The resolved config a `marge pretrain` run saved in its directory."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --run must be a directory written by `marge pretrain`")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_eval_model(args: argparse.Namespace):
    """(model, tokenizer, label) for --checkpoint / --snapshot / --random-init / --config."""
    import torch

    from marge.checkpoint import build_model, load_model
    from marge.snapshot import load_relevance_encoder, read_snapshot
    from marge.tokenizer import MargeTokenizer

    if args.snapshot:
        info = read_snapshot(Path(args.snapshot))
        tokenizer = MargeTokenizer.load(Path(args.corpus)) if args.corpus else None
        if tokenizer is None:
            raise ValueError("--snapshot needs --corpus (the tokenizer lives with the corpus)")
        return load_relevance_encoder(info), tokenizer, f"snapshot step {info.step}"
    if args.checkpoint:
        model = load_model(Path(args.checkpoint))  # validates the checkpoint's manifest first
        tokenizer = MargeTokenizer.load(Path(args.checkpoint))
        if args.random_init:
            torch.manual_seed(args.seed)
            return build_model(model.cfg).eval(), tokenizer, "random init"  # the checkpoint's family and shape
        return model, tokenizer, "trained"
    if args.config:
        from services.driver.config import load_config
        from marge.corpus import Corpus

        cfg = load_config(args.config)
        tokenizer = Corpus.open(args.corpus or cfg.data.corpus).tokenizer()
        torch.manual_seed(args.seed)
        return build_model(cfg.model_config(vocab_size=tokenizer.vocab_size)).eval(), tokenizer, "random init"
    raise ValueError("give --checkpoint PATH (a folder printed as `checkpoint` by marge pretrain), "
                     "--snapshot PATH --corpus DIR, or --config YAML --random-init")


def cmd_eval_retrieval(args: argparse.Namespace) -> int:
    from marge.evaluation import evaluate_model, evaluate_tfidf, mean_score, read_pairs

    pairs = read_pairs(Path(args.pairs))
    systems: dict[str, dict[str, float]] = {}
    if args.compare:
        if args.checkpoint:
            args.random_init = False
            model, tok, _ = load_eval_model(args)
            pairs = read_pairs(Path(args.pairs), tok.languages)  # the directions the model knows
            systems["trained"] = evaluate_model(model, tok, pairs, args.layer, args.margin)
        args.random_init = True
        model, tok, _ = load_eval_model(args)
        pairs = read_pairs(Path(args.pairs), tok.languages)
        systems["random_init"] = evaluate_model(model, tok, pairs, args.layer, args.margin)
        systems["tfidf"] = evaluate_tfidf(pairs, args.margin)
        result: dict = systems
    elif args.tfidf:
        result = evaluate_tfidf(pairs, args.margin)
        systems["tfidf"] = result
    else:
        model, tok, label = load_eval_model(args)
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


def read_document_pairs(path: Path, src: str, tgt: str, limit: int | None) -> list[tuple[str, str]]:
    """(source text, reference text) for every group that has both languages in a documents JSONL."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    by_group: dict[str, dict[str, str]] = {}
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            by_group.setdefault(row.get("group", row.get("id")), {})[row["language"]] = row["text"]
    pairs = [(langs[src], langs[tgt]) for _, langs in sorted(by_group.items()) if src in langs and tgt in langs]
    if not pairs:
        raise ValueError(f"{path}: no group has documents in both {src!r} and {tgt!r}")
    return pairs[:limit] if limit else pairs


def generation_config(args: argparse.Namespace):
    from marge.generate import GenerationConfig

    return GenerationConfig(beam=args.beam, no_repeat_ngram=args.no_repeat_ngram, max_len_a=args.max_len_a,
                            max_len_b=args.max_len_b)


def cmd_eval_translate(args: argparse.Namespace) -> int:
    from marge.evaluation import read_pairs
    from marge.finetuned import generation_scores
    from marge.generate import translate

    refuse_classifier(args.checkpoint)
    model, tok, _ = load_eval_model(args)
    if args.docs:
        pairs = read_document_pairs(Path(args.docs), args.src, args.tgt, args.limit)
    else:
        sets = [p for p in read_pairs(Path(args.pairs)) if (p.src_lang, p.tgt_lang) == (args.src, args.tgt)]
        if not sets:
            raise ValueError(f"{args.pairs}: no {args.src}->{args.tgt} pairs")
        pairs = list(zip(sets[0].sources, sets[0].targets))[: args.limit or None]
    cfg = generation_config(args)
    hypotheses = [" ".join(translate(model, tok, " ".join(src.split()), args.tgt, cfg).split()) for src, _ in pairs]
    references = [" ".join(ref.split()) for _, ref in pairs]
    scores = generation_scores(hypotheses, references, args.tgt)
    result = {"src": args.src, "tgt": args.tgt, "documents": len(pairs), "bleu": scores["bleu"],
              "chrf": scores["chrf"], "beam": cfg.beam, "no_repeat_ngram": cfg.no_repeat_ngram}
    if args.out:
        Path(args.out).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    print(json.dumps(result) if args.json else f"{args.src}->{args.tgt}: BLEU {scores['bleu']:.2f}  "
          f"chrF {scores['chrf']:.2f} ({len(pairs)} documents)")
    return 0


def cmd_translate(args: argparse.Namespace) -> int:
    from marge.generate import translate

    args.snapshot = None
    refuse_classifier(args.checkpoint)
    model, tok, _ = load_eval_model(args)
    if not hasattr(model, "decode"):
        raise ValueError(f"{args.checkpoint or args.config} holds a {type(model).__name__} model, an encoder that cannot "
                         "generate: translate with a MARGE or BART checkpoint (`marge eval retrieval` takes this one)")
    cfg = generation_config(args)
    for line in sys.stdin:
        if line.strip():
            print(translate(model, tok, line.rstrip("\n"), args.tgt_lang, cfg), flush=True)
    return 0


def refuse_classifier(checkpoint: str | None) -> None:
    """A fine-tuned classifier's decoder was trained to feed its head, not to write text: translating with it
    would print noise, so say which directory to use instead."""
    config = Path(checkpoint) / "finetune_config.json" if checkpoint else None
    if config is not None and config.is_file():
        task = json.loads(config.read_text(encoding="utf-8")).get("task")
        if task != "generation":
            raise ValueError(f"{checkpoint} is a model fine-tuned for {task}, which cannot translate: use a pre-training "
                             "checkpoint or a `marge finetune --task generation` directory (`marge eval finetuned` "
                             "evaluates this one)")


FREEZE_HELP = ("what to keep fixed, comma-separated: `embeddings` (word embeddings, tied to the output), "
               "`decoder-layers=N` (the first N decoder layers), `local-decoder-layers` (the decoder's "
               "self-attention-only layers), `zero-shot` (the paper's transfer recipe: embeddings and the first 4 "
               "decoder layers, i.e. the paper model's 4 self-attention-only ones)")


def parse_freeze(values: list[str] | None) -> tuple[bool, int, bool]:
    """(freeze embeddings, first decoder layers to freeze, freeze the self-attention-only layers) from `--freeze`."""
    embeddings, layers, local = False, 0, False
    for item in (x.strip() for v in values or [] for x in v.split(",")):
        if not item:
            continue
        if item == "embeddings":
            embeddings = True
        elif item == "local-decoder-layers":
            local = True
        elif item == "zero-shot":
            embeddings, local = True, True
        elif item.startswith("decoder-layers="):
            try:
                layers = max(layers, int(item.split("=", 1)[1]))
            except ValueError:
                raise ValueError(f"--freeze {item}: N in decoder-layers=N must be an integer") from None
        else:
            raise ValueError(f"--freeze {item!r} is not known; {FREEZE_HELP}")
    return embeddings, layers, local


def cmd_finetune(args: argparse.Namespace) -> int:
    from services.trainer.finetune import FinetuneConfig, run_finetune

    embeddings, layers, local = parse_freeze(args.freeze)
    cfg = FinetuneConfig(
        task=args.task, train=args.train, valid=args.valid, out=args.out, checkpoint=args.checkpoint,
        random_init=args.random_init, steps=args.steps, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, clip_norm=args.clip_norm,
        freeze_embeddings=embeddings, freeze_decoder_layers=layers,
        freeze_local_decoder_layers=local, eval_every=args.eval_every, metric=args.metric,
        patience=args.patience, valid_limit=args.valid_limit or None, classifier_dropout=args.classifier_dropout,
        pair_input=args.pair_input, workers=args.workers, ray_address=args.address, seed=args.seed, torch_threads=args.torch_threads,
        overwrite=args.overwrite)
    summary = run_finetune(cfg)
    best = summary.get("best")
    print(f"fine-tuned {summary['steps']} updates in {summary['seconds']:.0f} s -> {summary['out']}"
          + (f"; best validation {summary['metric']} {best[summary['metric']]:.4f} at update {best['step']}"
             if best else ""), file=sys.stderr)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("train_loss", "evaluations", "frozen_parameters")}),
          flush=True)
    return 0


def cmd_eval_finetuned(args: argparse.Namespace) -> int:
    from marge.finetuned import evaluate, load
    from marge.tasks import read_task_file

    model = load(args.model)
    task = model.task or "generation"  # a pre-training checkpoint generates zero-shot
    examples = read_task_file(args.data, task, model.tokenizer.languages, model.labels)[: args.limit or None]
    from tqdm import tqdm

    with tqdm(total=len(examples), desc="evaluating", unit="example", disable=not sys.stderr.isatty()) as bar:
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


def cmd_prepare_tasks(args: argparse.Namespace) -> int:
    from marge.demo_tasks import DemoTasksOptions, build_demo_tasks

    info = build_demo_tasks(DemoTasksOptions(corpus=Path(args.corpus), out=Path(args.out), seed=args.seed,
                                             overwrite=args.overwrite))
    print(json.dumps({"out": str(args.out), "counts": info.get("counts")}))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from services.retrieval.app import create_app, is_loopback

    token = os.environ.get("MARGE_API_TOKEN")
    if args.token_file:
        token = Path(args.token_file).read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty: write the bearer token into it (e.g. "
                             "`python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE`)")
    if not token and not is_loopback(args.host) and not args.insecure:
        raise ValueError(f"refusing to serve on {args.host} without a token: set MARGE_API_TOKEN or --token-file "
                         "(or pass --insecure if the network is trusted)")
    corpus = args.corpus or run_config(Path(args.run))["data"]["corpus"]
    settings = ServeSettings(run_dir=Path(args.run), corpus_dir=Path(corpus), token=token or None, max_k=args.max_k,
                             max_query_chars=args.max_query_chars, max_body_bytes=args.max_body_bytes,
                             max_in_flight=args.max_in_flight, poll_s=args.poll_s)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info",
                limit_concurrency=4 * args.max_in_flight)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from services.driver.report import make_report

    print(json.dumps(make_report(Path(args.run), Path(args.out), args.pairs, args.checkpoint, args.max_snapshots)))
    return 0


def cmd_experiment_learning(args: argparse.Namespace) -> int:
    if args.single_process:
        from services.driver.single_process import run_single_process

        report = run_single_process(args.config, args.overrides, args.minutes, args.out, args.resume, args.device)
    else:
        if args.resume or args.device != "auto":
            raise ValueError("--resume and --device belong to --single-process runs (a pipeline run resumes from its "
                             "checkpoint when submitted again with the same run.name and run.dir)")
        from services.driver.experiment import main_experiment

        report = main_experiment(args.config or Path("deploy/configs/learning.yaml"), args.overrides, args.minutes,
                                 args.out)
    keys = ("evidence_gain", "p_at_1_mean", "targets", "checkpoint", "curves")
    print(json.dumps({k: report[k] for k in keys}))
    return 0


def cmd_experiment_objectives(args: argparse.Namespace) -> int:
    from services.driver.objectives_experiment import run_objectives_experiment

    only = [name.strip() for name in args.only.split(",")] if args.only else None
    report = run_objectives_experiment(args.config, args.overrides, args.minutes, args.out, only, args.device,
                                       args.chrf_pairs)
    table = [{k: row[k] for k in ("variant", "parameters", "updates", "final_losses", "chrf_zero_shot_mean")}
             | {"p_at_1": round(row["p_at_1_best_layer"]["mean"], 4), "layer": row["p_at_1_best_layer"]["layer"]}
             for row in report["variants"]]
    print(json.dumps({"variants": table, "report": str(Path(args.out) / "report.json"), "plot": report["plot"]}))
    return 0


def cmd_experiment_ceiling(args: argparse.Namespace) -> int:
    from services.driver.ceiling_experiment import run_ceiling

    def names(value: str | None) -> list[str] | None:
        return [n.strip() for n in value.split(",") if n.strip()] if value else None

    report = run_ceiling(args.config, args.overrides, args.minutes, args.out, names(args.arms), args.sweep_minutes,
                         names(args.sizes), args.size, args.device)
    print(json.dumps({"size": report["size"], "headline_ratios": report["headline_ratios"], "targets": report["targets"],
                      "report": str(Path(args.out) / "report.json")}))
    return 0


def named_paths(values: list[str], flag: str) -> dict[str, Path]:
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{flag} {value!r}: expected NAME=PATH")
        out[name] = Path(path)
    return out


def cmd_experiment_finetune(args: argparse.Namespace) -> int:
    from services.driver.finetune_experiment import run_finetune_experiment

    steps = {name: int(value) for name, value in (s.split("=", 1) for s in args.steps)}
    report = run_finetune_experiment(named_paths(args.checkpoint, "--checkpoint"), args.tasks, args.out, args.work,
                                     args.seed, args.only.split(",") if args.only else None, args.eval_limit, steps)
    table = [{"system": r["system"], "task": r["task"], "updates": r["updates"],
              **{k: round(v, 4) for k, v in r["test"].items() if k in ("accuracy", "macro_f1", "bleu", "chrf")},
              **({"zero_shot_accuracy_mean": round(r["zero_shot_accuracy_mean"], 4)}
                 if r.get("zero_shot_accuracy_mean") is not None else {})} for r in report["rows"]]
    print(json.dumps({"rows": table, "report": str(Path(args.out) / "report.json")}))
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    from services.driver.config_reference import reference

    text = reference()
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    """Resize a running job's indexer pool; the coordinator applies it from the next index version."""
    import os

    import ray

    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError("marge scale needs the Ray cluster: --address HOST:PORT (as `ray start --head` prints it) "
                         "or RAY_ADDRESS")
    if args.indexer_workers < 1:
        raise ValueError(f"--indexer-workers must be >= 1, got {args.indexer_workers}")
    namespace = f"marge-{args.run}"
    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING)
    try:
        try:
            coordinator = ray.get_actor("marge-indexer-coordinator")
        except ValueError:
            raise ValueError(f"no indexer of a run named {args.run!r} on {address} (namespace {namespace}): is it "
                             "training, and does it build an index (BART alone has none)? `ray list actors` shows "
                             "the running ones") from None
        pool = ray.get(coordinator.pool.remote())
        extra_cpus = (args.indexer_workers - pool["wanted"]) * pool["cpus_per_worker"]
        free = ray.available_resources().get("CPU", 0.0)
        if extra_cpus > free + 1e-9:
            raise ValueError(f"{args.indexer_workers} indexer workers need {extra_cpus:g} more logical CPUs "
                             f"({pool['cpus_per_worker']:g} each) but the cluster has {free:g} free: add a node "
                             "or ask for fewer workers")
        result = ray.get(coordinator.scale.remote(args.indexer_workers))
    finally:
        ray.shutdown()  # the connection only
    print(json.dumps({"run": args.run, **result}))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from services.driver.config import load_config
    from services.driver.plan import describe, estimated_throughput, load_throughput, measure_throughput, plan_capacity

    cfg = load_config(args.config, args.overrides)
    corpus = None
    if (Path(cfg.data.corpus) / "manifest.json").exists():
        from marge.corpus import Corpus

        corpus = Corpus.open(cfg.data.corpus, verify_checksums=False)
    if args.measure:
        if corpus is None:
            raise FileNotFoundError(f"--measure needs the prepared corpus {cfg.data.corpus} (run `marge prepare` first)")
        measured = measure_throughput(cfg, corpus, torch.device(args.device))
        text = json.dumps(measured, indent=2)
        if args.out:
            Path(args.out).write_text(text + "\n", encoding="utf-8")
        print(text)
        return 0
    if args.documents:
        documents, tokens, languages = args.documents, args.document_tokens, args.languages
    elif corpus is not None:
        m = corpus.manifest
        documents, tokens, languages = m["num_documents"], m["num_tokens"] / m["num_documents"], len(m["languages"])
    else:
        raise FileNotFoundError(f"{cfg.data.corpus} is not prepared here: give its size with --documents N "
                                "(and --document-tokens, --languages)")
    rates = load_throughput(args.measured) if args.measured else estimated_throughput(cfg)
    if rates is None:
        raise ValueError("this config's workers use GPUs and this machine has none: measure on a worker "
                         "(`marge plan --measure --device cuda --out FILE`) and pass --measured FILE")
    vocab = corpus.tokenizer().vocab_size if corpus is not None else cfg.data.vocab_size
    plan = plan_capacity(cfg, cfg.model_config(vocab_size=vocab), documents, tokens, languages, rates)
    if args.json:
        print(json.dumps(plan))
    else:
        for line in describe(plan, cfg):
            print(line)
    return 0


def layer_arg(text: str) -> int | str:
    if text == "g":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer must be a layer number or g, got {text!r}") from None


def parse_override(text: str) -> tuple[str, object]:
    """'key=value' with value parsed as YAML (numbers, booleans, lists)."""
    import yaml

    if "=" not in text:
        raise SystemExit(f"override {text!r} must look like key=value")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marge", description="MARGE pre-training pipeline")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    parser.add_argument("--version", action="version", version=f"marge {__import__('marge').__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="raw documents -> sharded Parquet corpus + tokenizer")
    p.add_argument("inputs", nargs="+", type=Path, help=".jsonl/.jsonl.gz files or folders laid out as <root>/<lang>/...")
    p.add_argument("--out", type=Path, required=True, help="output folder (written atomically)")
    p.add_argument("--tokenizer", type=Path, default=None, help="reuse the tokenizer in this folder instead of training one")
    p.add_argument("--vocab-size", type=int, default=16000, help="tokenizer vocabulary (default 16000; the paper: 250k)")
    p.add_argument("--max-chunk-tokens", type=int, default=512, help="tokens per document chunk, specials included (paper: 512)")
    p.add_argument("--document-unit", choices=("chunk", "paragraph"), default="chunk",
                   help="chunk: paragraphs packed into documents of up to --max-chunk-tokens (the paper); paragraph: "
                        "every paragraph a document, cut at --max-chunk-tokens")
    p.add_argument("--min-document-tokens", type=int, default=1, help="drop documents with fewer text tokens")
    p.add_argument("--heldout-permille", type=int, default=0,
                   help="groups per 1000 held out of training for the runs' probes and P@1 (written to heldout/)")
    p.add_argument("--docs-per-shard", type=int, default=512, help="target chunks per shard (default 512)")
    p.add_argument("--num-shards", type=int, default=None, help="exact number of shards (overrides --docs-per-shard)")
    p.add_argument("--languages", default=None, help="keep only these comma-separated ISO 639-1 languages")
    p.add_argument("--no-lid", action="store_true", help="trust the language labels; skip language identification")
    p.add_argument("--lid-threshold", type=float, default=0.5,
                   help="language ID confidence above which a contradicting label is an error (default 0.5)")
    p.add_argument("--max-document-chars", type=int, default=1_000_000, help="longest accepted document")
    p.add_argument("--skip-bad-documents", action="store_true", help="drop (and count) bad documents instead of stopping")
    p.add_argument("--seed", type=int, default=0, help="seed of the shard assignment")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("pretrain", help="run MARGE pre-training on Ray (indexer -> batcher -> Redis -> DDP trainers)")
    p.add_argument("--config", type=Path, default=Path("deploy/configs/tiny.yaml"),
                   help="pipeline config (default deploy/configs/tiny.yaml)")
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="config overrides, e.g. run.max_steps=200")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("serve", help="the retrieval service (FastAPI on uvicorn) over a run's newest index")
    p.add_argument("--run", required=True, type=Path, help="run directory of `marge pretrain` (its index/ is served)")
    p.add_argument("--corpus", default=None, help="prepared corpus (default: the run's data.corpus)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--token-file", default=None, help="file with the bearer token (or set MARGE_API_TOKEN)")
    p.add_argument("--max-k", type=int, default=SERVE_DEFAULTS["max_k"])
    p.add_argument("--max-query-chars", type=int, default=SERVE_DEFAULTS["max_query_chars"])
    p.add_argument("--max-body-bytes", type=int, default=SERVE_DEFAULTS["max_body_bytes"])
    p.add_argument("--max-in-flight", type=int, default=SERVE_DEFAULTS["max_in_flight"])
    p.add_argument("--poll-s", type=float, default=SERVE_DEFAULTS["poll_s"], help="how often to look for a newer index version")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without a token")
    p.set_defaults(func=cmd_serve)

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

    p = sub.add_parser("finetune", help="fine-tune a checkpoint on a generation or classification task (JSONL)")
    p.add_argument("--task", required=True, choices=["generation", "classification"],
                   help="generation: {source, target, target_language}; classification: {text, text_pair?, label}")
    p.add_argument("--checkpoint", required=True, help="a pre-training checkpoint (`checkpoint` in marge pretrain's "
                                                       "summary) or a fine-tuned model folder")
    p.add_argument("--random-init", action="store_true", help="random weights of the checkpoint's shape (the baseline)")
    p.add_argument("--train", required=True, help="training JSONL")
    p.add_argument("--valid", default=None, help="validation JSONL: early stopping and the best model")
    p.add_argument("--out", required=True, help="the model folder to write (safetensors, configs, tokenizer, metrics)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, default=None, help="optimizer updates")
    budget.add_argument("--epochs", type=float, default=None, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=16, help="examples per update, over all workers")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up (default 6%% of the updates), then "
                                                                   "linear decay to 0")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-norm", type=float, default=1.0)
    p.add_argument("--freeze", action="append", metavar="WHAT", help=FREEZE_HELP)
    p.add_argument("--eval-every", type=int, default=None, help="validate every N updates (default: 10 times a run)")
    p.add_argument("--metric", default=None, help="validation metric to stop on: chrf, bleu or loss (generation); "
                                                  "accuracy, macro_f1 or loss (classification)")
    p.add_argument("--patience", type=int, default=3, help="stop after N evaluations without improvement (0: never)")
    p.add_argument("--valid-limit", type=int, default=64, help="validate on the first N examples (0: all)")
    p.add_argument("--classifier-dropout", type=float, default=0.1)
    p.add_argument("--pair-input", default="both", choices=["both", "split"],
                   help="classification pairs: both (the paper's: the joined pair into encoder and decoder) or split "
                        "(text into the encoder, pair into the decoder, as MARGE pre-trains)")
    p.add_argument("--workers", type=int, default=1, help="DDP ranks on Ray Train (1: this process, no Ray)")
    p.add_argument("--address", default=None, help="Ray cluster for --workers > 1 (default: a local Ray)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("scale", help="resize a running job's indexer pool (from its next index version)")
    p.add_argument("--run", required=True, help="the job's run.name")
    p.add_argument("--indexer-workers", type=int, required=True, help="indexer workers wanted")
    p.add_argument("--address", default=None, help="the Ray cluster, HOST:PORT as `ray start --head` prints it "
                                                   "(default: RAY_ADDRESS)")
    p.set_defaults(func=cmd_scale)

    p = sub.add_parser("prepare-tasks", help="build the demo fine-tuning tasks (translation, PAWS-X-like pairs) from "
                                             "the bundled corpus")
    p.add_argument("--corpus", default="data/demo/libreoffice-help", help="the demo corpus folder")
    p.add_argument("--out", default="data/demo/tasks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_prepare_tasks)

    p = sub.add_parser("translate", help="translate documents (one per stdin line) into --tgt-lang")
    model_args(p)
    p.add_argument("--tgt-lang", required=True)
    generation_args(p)
    p.set_defaults(func=cmd_translate)

    p = sub.add_parser("report", help="link matrix (paper Fig. 2) and learning curves of a run")
    p.add_argument("--run", required=True, help="run directory of `marge pretrain`")
    p.add_argument("--out", required=True, help="folder for link_matrix.{csv,png}, curves.png, report.json")
    p.add_argument("--pairs", default=None, help="held-out pairs TSV for P@1 per snapshot (default: the run's)")
    p.add_argument("--checkpoint", default=None, help="build the link matrix from this checkpoint's own index")
    p.add_argument("--max-snapshots", type=int, default=8)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("experiment", help="experiments: `learning` (does the retrieval loop learn?), `objectives` "
                                          "(MARGE vs BART vs VECO), `finetune` (downstream tasks)")
    exp_sub = p.add_subparsers(dest="experiment", required=True)
    q = exp_sub.add_parser("learning", help="run the pipeline N minutes and measure what it learned, next to baselines")
    q.add_argument("--minutes", type=float, required=True, help="wall-clock minutes of training")
    q.add_argument("--out", type=Path, required=True, help="folder for report.json, curves.png and the run")
    q.add_argument("--config", type=Path, default=None,
                   help="pipeline config (default deploy/configs/learning.yaml, the recipe)")
    q.add_argument("--single-process", action="store_true",
                   help="indexer, batcher and trainer cores in this process: no Ray, Redis or FAISS (one GPU, debugging)")
    q.add_argument("--resume", action="store_true",
                   help="--single-process: continue the run in --out for --minutes more (its own config)")
    q.add_argument("--device", default="auto", help="--single-process: auto (CUDA when present), cpu or cuda[:N]")
    q.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE")
    q.set_defaults(func=cmd_experiment_learning)
    q = exp_sub.add_parser("objectives", help="MARGE, BART, VECO and a mixture on the same data for the same minutes, "
                                              "side by side (single-process runs)")
    q.add_argument("--minutes", type=float, required=True, help="wall-clock training minutes of each variant")
    q.add_argument("--out", type=Path, required=True, help="folder for report.json, comparison.png and one run per "
                                                           "variant (finished variants are kept on a second run)")
    q.add_argument("--config", type=Path, default=None, help="base config (default deploy/configs/learning.yaml)")
    q.add_argument("--only", default=None, help="comma-separated variants: marge, bart, veco, marge+bart")
    q.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    q.add_argument("--chrf-pairs", type=int, default=8,
                   help="held-out pairs per direction (to/from en) translated for chrF (0: none)")
    q.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="applied to every variant")
    q.set_defaults(func=cmd_experiment_objectives)
    q = exp_sub.add_parser("ceiling", help="the MARGE loop against its ceiling (aligned oracle), the paper's loop and a "
                                           "frozen lexical index, equal minutes each (single-process runs)")
    q.add_argument("--minutes", type=float, required=True, help="wall-clock training minutes of each arm (0: report only)")
    q.add_argument("--out", type=Path, required=True, help="folder for report.json, curves.png, the sweep and one run "
                                                           "per arm (finished arms are kept: run it again to resume)")
    q.add_argument("--config", type=Path, default=None, help="base config (default deploy/configs/learning.yaml)")
    q.add_argument("--arms", default=None, help="comma-separated: oracle, loop, paper, lexical_frozen, mechanism")
    q.add_argument("--sweep-minutes", type=float, default=0.0,
                   help="first run the oracle arm at each width for this many minutes and use the best width")
    q.add_argument("--sizes", default=None, help="widths of the sweep (default d64,d128,d192)")
    q.add_argument("--size", default=None, help="use this width (d64, d128, d192) instead of the sweep's choice")
    q.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    q.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="applied to every arm")
    q.set_defaults(func=cmd_experiment_ceiling)
    q = exp_sub.add_parser("finetune", help="the demo tasks fine-tuned from each checkpoint and from random init, "
                                            "one recipe and budget, scored on test")
    q.add_argument("--checkpoint", action="append", required=True, metavar="NAME=PATH",
                   help="a starting point (repeatable), e.g. marge=runs/.../step-00000600; random init takes the "
                        "first one's shape and tokenizer")
    q.add_argument("--tasks", type=Path, default=Path("data/demo/tasks"), help="the task set (`marge prepare-tasks`)")
    q.add_argument("--out", type=Path, required=True, help="folder for report.json (finished systems are kept)")
    q.add_argument("--work", type=Path, default=Path("runs/finetune"), help="where the fine-tuned models go")
    q.add_argument("--only", default=None, help="comma-separated tasks: translation, pawsx")
    q.add_argument("--steps", action="append", default=[], metavar="TASK=N", help="override a task's update budget")
    q.add_argument("--eval-limit", type=int, default=None, help="score only the first N test examples")
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=cmd_experiment_finetune)

    p = sub.add_parser("config", help="the configuration: `reference` prints every section and field")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    q = config_sub.add_parser("reference", help="every config key with its type, default, the paper's value and "
                                                "its documentation, as Markdown (docs/configuration.md)")
    q.add_argument("--out", default=None, help="write it here instead of printing it")
    q.set_defaults(func=cmd_config_reference)

    p = sub.add_parser("plan", help="capacity model: does the indexer pool keep up with the trainers?")
    p.add_argument("--config", type=Path, default=Path("deploy/configs/tiny.yaml"))
    p.add_argument("--measured", type=Path, default=None,
                   help="throughput measured by `marge plan --measure` (default: a quick matrix-product estimate)")
    p.add_argument("--measure", action="store_true",
                   help="measure one indexer and one trainer worker on this machine (needs the prepared corpus)")
    p.add_argument("--device", default="cpu", help="--measure: cpu or cuda")
    p.add_argument("--out", default=None, help="--measure: write the measurements here")
    p.add_argument("--documents", type=int, default=None, help="corpus size when it is not prepared here")
    p.add_argument("--document-tokens", type=float, default=400.0, help="mean tokens per document (with --documents)")
    p.add_argument("--languages", type=int, default=26, help="languages in the corpus (with --documents)")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="SECTION.KEY=VALUE")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("audit", help="was every batch of a run trained exactly once? (exit 1 if one was lost or twice)")
    p.add_argument("--run", required=True, type=Path, help="run directory of `marge pretrain`")
    p.add_argument("--redis-url", default=None, help="the run's Redis if it was external (or set MARGE_REDIS_URL)")
    p.add_argument("--json", action="store_true", help="only the JSON object (always printed last, on one line)")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("queue", help="a run's dead-lettered batches: list them, requeue them")
    queue_sub = p.add_subparsers(dest="queue_command", required=True)
    for name, text in (("list-dead", "list the batches that could not be trained, with slot and reason"),
                       ("replay", "requeue dead-lettered batches (entries from list-dead)")):
        q = queue_sub.add_parser(name, help=text)
        q.add_argument("--run", required=True, type=Path, help="run directory of `marge pretrain`")
        q.add_argument("--redis-url", default=None, help="the run's Redis if it was external (or set MARGE_REDIS_URL)")
        if name == "replay":
            q.add_argument("entries", nargs="+", metavar="ENTRY", help="dead-letter entry ids")
        else:
            q.add_argument("--json", action="store_true")
        q.set_defaults(func=cmd_queue)

    p = sub.add_parser("info", help="a model preset's configuration and parameter count")
    p.add_argument("--preset", required=True, help="tiny, base or paper")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a model field (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)
    return parser


def exit_cleanly_on_sigterm() -> None:
    """`ray job stop`, `kill` and CI time-outs send SIGTERM: exit through the normal path so that what the
    command started (a private redis-server, a local Ray) is stopped by its `finally` blocks."""
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if args.command in ("pretrain", "experiment", "finetune"):
        exit_cleanly_on_sigterm()
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a reader that went away is handled, not at interpreter exit
        return code
    except (ValueError, FileNotFoundError, FileExistsError, RunLocked) as e:
        # bad input or configuration: one clear line, no traceback (set MARGE_LOG_LEVEL=DEBUG for it)
        log.debug("error details", exc_info=True)
        print(f"marge {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`marge info | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second complaint when Python flushes
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
