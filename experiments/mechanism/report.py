"""The mechanism study's report: every arm over its seeds, and the named contrasts, with intervals that resample
seeds and pages.

Intervals. A P@1 or an evidence gain of an arm is a mean over its seeds of a mean over held-out items; its `ci95`
is a two-level bootstrap (seeds with replacement, then pages with replacement, the same page draw for every seed:
paragraphs of one page are not independent, and neither are the 8 directions of one pair). `ci95_seeds_t` is the
t interval over the seeds' own means (what seed-to-seed variance alone allows, n - 1 degrees of freedom). A
contrast is paired: seed s of one arm against seed s of the other (the same initial weights and, until the arms'
indexes differ, the same batches), item by item. A contrast is **shown** only when both intervals lie above 0.

    report.json   arms.<name> = {seeds, updates, aux_loss, detached_f, index, p_at_1, p_at_1_init, nll, gains,
                  aligned_link_precision, ...}; contrasts.<name> = {delta, ci95, ci95_seeds_t, ...}; targets
    curves.png
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import yaml

from marge.eval.evaluation import clustered_bootstrap, own_page_pairs, page_sums
from marge.util.files import atomic_write_text

log = logging.getLogger("marge.mechanism")

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
"""Two-sided 95% quantiles of Student's t by degrees of freedom (seeds - 1)."""


def t_interval(values: list[float]) -> list[float] | None:
    if len(values) < 2:
        return None
    v = np.asarray(values, dtype=np.float64)
    half = T_975.get(len(v) - 1, 1.96) * v.std(ddof=1) / np.sqrt(len(v))
    return [float(v.mean() - half), float(v.mean() + half)]


# ----------------------------------------------------------------------------------------------------
# Reading the runs
# ----------------------------------------------------------------------------------------------------


def read_runs(out: Path) -> dict[str, dict[int, dict]]:
    """{arm: {seed: {"measures", "builds", "baselines", "updates"}}} of every measured run in a study folder."""
    runs: dict[str, dict[int, dict]] = {}
    for folder in sorted(Path(out).glob("runs/*/seed-*")):
        measures = folder / "measures.json"
        if not folder.is_dir() or not measures.exists():
            continue
        builds_path = folder / "run" / "index_builds.jsonl"
        builds = [json.loads(line) for line in builds_path.read_text(encoding="utf-8").splitlines()
                  if line.strip()] if builds_path.exists() else []
        report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
        log_path = folder / "run" / "train_log.jsonl"
        updates = [json.loads(line) for line in log_path.read_text(encoding="utf-8").splitlines()
                   if line.strip()] if log_path.exists() else []
        config_path = folder / "config.yaml"
        config = yaml.safe_load(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        runs.setdefault(folder.parent.name, {})[int(folder.name.split("-", 1)[1])] = {
            "measures": json.loads(measures.read_text(encoding="utf-8")), "builds": builds,
            "baselines": json.loads((folder / "baselines.json").read_text(encoding="utf-8")),
            "updates": int(report["pipeline"]["steps"]), "minutes": report["pipeline"]["train_seconds"] / 60,
            "train_log": updates, "beta_lr_scale": float(((config or {}).get("trainer") or {}).get("beta_lr_scale", 1.0))}
    return runs


def common_steps(seeds: dict[int, dict]) -> list[int]:
    steps = None
    for run in seeds.values():
        mine = {int(s) for s in run["measures"]["steps"]}
        steps = mine if steps is None else steps & mine
    return sorted(steps or [])


# ----------------------------------------------------------------------------------------------------
# Item values per page
# ----------------------------------------------------------------------------------------------------


class Pages:
    """A fixed page index over the probe's targets and the pairs' queries (the same for every run)."""

    def __init__(self, any_measures: dict):
        self.pair_pages = {k: np.asarray(v, dtype=object) for k, v in any_measures["pair_pages"].items()}
        first = next(iter(any_measures["steps"].values()))
        self.target_pages = np.asarray(first["groups"], dtype=object)
        names = sorted({*self.target_pages.tolist(), *(p for v in self.pair_pages.values() for p in v.tolist())})
        self.index = {p: i for i, p in enumerate(names)}

    def hits(self, record: dict, minus: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(per-page sums, counts) of P@1 hits, or of hits minus `minus`'s hits (a paired difference)."""
        values = {k: np.asarray(v, dtype=np.float64) for k, v in record["p_at_1_hits"].items()}
        if minus is not None:
            values = {k: v - np.asarray(minus["p_at_1_hits"][k], dtype=np.float64) for k, v in values.items()}
        return page_sums(values, self.pair_pages, self.index)

    def gain(self, record: dict, condition: str, minus: tuple[dict, str] | None = None,
             baseline: str = "none") -> tuple[np.ndarray, np.ndarray]:
        """(per-page sums of NLL(baseline) - NLL(condition), per-page target tokens): a gain in nats per token; with
        `minus` = (record, condition), the paired difference of two gains."""
        gain = np.asarray(record["nll_sum"][baseline]) - np.asarray(record["nll_sum"][condition])
        if minus is not None:
            other, cond = minus
            gain = gain - (np.asarray(other["nll_sum"][baseline]) - np.asarray(other["nll_sum"][cond]))
        return self.per_target(gain, record["tokens"])

    def per_target(self, values: np.ndarray, tokens) -> tuple[np.ndarray, np.ndarray]:
        """(per-page sums of per-target `values`, per-page target tokens): a mean per target token."""
        idx = np.array([self.index[p] for p in self.target_pages], dtype=np.int64)
        sums, counts = np.zeros(len(self.index)), np.zeros(len(self.index))
        np.add.at(sums, idx, np.asarray(values, dtype=np.float64))
        np.add.at(counts, idx, np.asarray(tokens, dtype=np.float64))
        return sums, counts


def summarise(rows: list[tuple[np.ndarray, np.ndarray]], seed: int = 0) -> dict:
    """Mean, two-level bootstrap CI and t interval over seeds of per-seed (page sums, page counts)."""
    sums = np.stack([r[0] for r in rows])
    counts = np.stack([r[1] for r in rows])
    boot = clustered_bootstrap(sums, counts, seed=seed)
    per_seed = (sums.sum(1) / np.maximum(counts.sum(1), 1e-12)).tolist()
    return {"mean": round(boot["mean"], 5), "ci95": [round(x, 5) for x in boot["ci95"]],
            "ci95_seeds_t": [round(x, 5) for x in t_interval(per_seed)] if len(per_seed) > 1 else None,
            "by_seed": [round(x, 5) for x in per_seed]}


def shown(summary: dict) -> bool:
    """Above 0 by both intervals (a single seed never shows anything)."""
    t = summary.get("ci95_seeds_t")
    return bool(t) and summary["ci95"][0] > 0 and t[0] > 0


# ----------------------------------------------------------------------------------------------------
# Arms and contrasts
# ----------------------------------------------------------------------------------------------------


def arm_summary(name: str, seeds: dict[int, dict], pages: Pages) -> dict:
    from experiments.mechanism.arms import ARM_NAMES, arm_named

    steps = common_steps(seeds)
    if not steps:
        return {}
    final = str(steps[-1])
    order = sorted(seeds)
    records = [seeds[s]["measures"]["steps"][final] for s in order]
    inits = [seeds[s]["measures"]["steps"]["0"] for s in order]
    conditions = list(records[0]["nll_sum"])
    tokens = [sum(r["tokens"]) for r in records]
    nll = {c: round(float(np.mean([sum(r["nll_sum"][c]) / t for r, t in zip(records, tokens)])), 5) for c in conditions}
    gains = {c: summarise([pages.gain(r, c) for r in records]) for c in conditions if c != "none"}
    over_wrong_page = {c: summarise([pages.gain(r, c, baseline="wrong_page") for r in records])
                       for c in conditions if c not in ("none", "wrong_page")}
    over = {}
    for step in steps:
        rs = [seeds[s]["measures"]["steps"][str(step)] for s in order]
        over[str(step)] = {"p_at_1": summarise([pages.hits(r) for r in rs]),
                           "p_at_1_over_init": summarise([pages.hits(r, minus=i) for r, i in zip(rs, inits)]),
                           "headroom": {
                               "retrieved_minus_gold": summarise([pages.gain(r, "gold", baseline="retrieved")
                                                                  for r in rs]),
                               "wrong_page_minus_retrieved": summarise([pages.gain(r, "retrieved", baseline="wrong_page")
                                                                        for r in rs])},
                           "gain_retrieved": summarise([pages.gain(r, "retrieved") for r in rs]),
                           "gain_gold": summarise([pages.gain(r, "gold") for r in rs]),
                           "retrieved_over_wrong_page": summarise([pages.gain(r, "retrieved", baseline="wrong_page")
                                                                   for r in rs]),
                           "nll": {c: round(float(np.mean([sum(r["nll_sum"][c]) / sum(r["tokens"]) for r in rs])), 4)
                                   for c in rs[0]["nll_sum"]},
                           **{name: summarise([pages.per_target(np.asarray(r[name], dtype=np.float64),
                                                                np.ones(len(r[name]))) for r in rs])
                              for name in ("reading_top_is_gold", "f_top_is_gold") if all(name in r for r in rs)},
                           "beta": round(float(np.mean([r["beta"] for r in rs])), 4),
                           "retrieved_precision": round(float(np.mean(
                               [r["retrieved_links"]["crosslingual_parallel_precision"] for r in rs])), 4)}
    builds = {}
    for s in order:
        for b in seeds[s]["builds"]:
            builds.setdefault(int(b["version"]), []).append(b)
    precision = [{"version": v, "snapshot_step": bs[0]["snapshot_step"], "link_sources": bs[0].get("link_sources"),
                  "lexical_weight": bs[0].get("lexical_weight"),
                  "mean": round(float(np.mean([b["crosslingual_parallel_precision"] for b in bs])), 4),
                  "by_seed": [round(b["crosslingual_parallel_precision"], 4) for b in bs]}
                 for v, bs in sorted(builds.items()) if len(bs) == len(order) and bs[0]["snapshot_step"] <= steps[-1]
                 and all(b.get("crosslingual_parallel_precision") is not None for b in bs)]
    arm = arm_named(name) if name in ARM_NAMES else None
    tfidf = [float(np.mean(list(seeds[s]["baselines"]["tfidf"].values()))) for s in order]
    return {
        "why": arm.why if arm else None, "overrides": list(arm.overrides) if arm else None,
        "lever": arm.lever if arm else None,
        "seeds": order, "updates": steps[-1], "aux_loss": arm.aux_loss if arm else None,
        "detached_f": arm.detached_f if arm else None, "index": arm.index if arm else None,
        "minutes_by_seed": [round(seeds[s]["minutes"], 1) for s in order],
        "p_at_1": summarise([pages.hits(r) for r in records]),
        "p_at_1_init": summarise([pages.hits(r) for r in inits]),
        "p_at_1_over_init": summarise([pages.hits(r, minus=i) for r, i in zip(records, inits)]),
        "p_at_1_tfidf": round(float(np.mean(tfidf)), 4),
        "nll": nll, "gains": gains, "gains_over_wrong_page": over_wrong_page,
        "retrieved_links": {k: round(float(np.mean([r["retrieved_links"][k] for r in records])), 4)
                            for k in records[0]["retrieved_links"]},
        "retrieved_g_links": {k: round(float(np.mean([r["retrieved_g_links"][k] for r in records])), 4)
                              for k in records[0]["retrieved_g_links"]},
        "beta": round(float(np.mean([r["beta"] for r in records])), 4),
        "aligned_link_precision": precision,
        "over_updates": over,
        "p_at_1_over_updates": {"init": over[str(steps[0])]["p_at_1"] if steps[0] == 0 else None,
                                **{k: v["p_at_1"] for k, v in over.items()}},
        "headroom": {k: v["headroom"] for k, v in over.items()},
        "f_gradient_share": gradient_shares(seeds, order, steps[-1]),
        "beta_over_adam_max": beta_over_adam_max(seeds, order, steps),
        "extended": extended_seeds(seeds, steps[-1]),
    }


GRADIENT_FIGURES = ("f_gradient_share", "f_gradient_share_embedding", "f_gradient_share_layers",
                    "distillation_gradient_share", "g_gradient_norm")
"""What `services.trainer.gradient_paths` puts in the health record of every snapshot update."""


def gradient_shares(seeds: dict[int, dict], order: list[int], last: int) -> dict:
    """{figure: {update: {mean, by_seed}}} of the gradient-path figures the runs logged at their snapshots, up to
    update `last` (updates every seed logged)."""
    out: dict[str, dict] = {}
    for figure in GRADIENT_FIGURES:
        by_step: dict[int, list[float]] = {}
        for s in order:
            for record in seeds[s]["train_log"]:
                value = (record.get("health") or {}).get(figure)
                if value is not None and record["step"] <= last:
                    by_step.setdefault(int(record["step"]), []).append(float(value))
        rows = {str(k): {"mean": round(float(np.mean(v)), 6), "by_seed": [round(x, 6) for x in v]}
                for k, v in sorted(by_step.items()) if len(v) == len(order)}
        if rows:
            out[figure] = rows
    return out


def beta_over_adam_max(seeds: dict[int, dict], order: list[int], steps: list[int]) -> dict:
    """For each span between measured updates, beta's rise (the checkpoints' beta) over the most Adam lets it rise
    in that span (the sum of beta's learning rates over its updates: an Adam update moves a parameter by about its
    learning rate at most), mean and by seed. Near 1: beta rises as fast as the optimizer allows, so the loss wants
    a larger bias than it can take."""
    out = {}
    for start, end in zip(steps, steps[1:]):
        ratios = []
        for s in order:
            lrs = {int(r["step"]): float(r["lr"]) for r in seeds[s]["train_log"]}
            span = range(start + 1, end + 1)
            if not all(k in lrs for k in span):
                break
            most = sum(lrs[k] for k in span) * seeds[s]["beta_lr_scale"]
            measured = seeds[s]["measures"]["steps"]
            ratios.append((measured[str(end)]["beta"] - measured[str(start)]["beta"]) / most)
        if len(ratios) == len(order):
            out[f"{start}-{end}"] = {"mean": round(float(np.mean(ratios)), 4), "by_seed": [round(r, 4) for r in ratios]}
    return out


def extended_seeds(seeds: dict[int, dict], common: int) -> dict:
    """Seeds trained past the arm's common last update (a longer diagnostic run): their own curves, one seed each,
    kept apart from the arm's figures."""
    out = {}
    for s, run in sorted(seeds.items()):
        later = sorted(int(k) for k in run["measures"]["steps"] if int(k) > common)
        if not later:
            continue
        steps = [0, *(k for k in sorted(int(k) for k in run["measures"]["steps"]) if k > 0)]
        records = {k: run["measures"]["steps"][str(k)] for k in steps}
        out[str(s)] = {
            "updates": later[-1],
            "p_at_1": {str(k): round(r["p_at_1"], 4) for k, r in records.items()},
            "nll": {str(k): {c: round(sum(v) / sum(r["tokens"]), 4) for c, v in r["nll_sum"].items()}
                    for k, r in records.items()},
            "retrieved_precision": {str(k): round(r["retrieved_links"]["crosslingual_parallel_precision"], 4)
                                    for k, r in records.items()},
            "beta": {str(k): round(r["beta"], 4) for k, r in records.items()},
            "aligned_link_precision": [{"version": b["version"], "snapshot_step": b["snapshot_step"],
                                        "lexical_weight": b.get("lexical_weight"),
                                        "precision": round(b["crosslingual_parallel_precision"], 4)}
                                       for b in run["builds"] if b.get("crosslingual_parallel_precision") is not None],
        }
    return out


def contrast(first: dict[int, dict], second: dict[int, dict], pages: Pages, step: int) -> dict:
    """first minus second, paired by seed, at update `step`: P@1 of g and the retrieved-evidence gain."""
    both = sorted(set(first) & set(second))
    a = [first[s]["measures"]["steps"][str(step)] for s in both]
    b = [second[s]["measures"]["steps"][str(step)] for s in both]
    p = summarise([pages.hits(x, minus=y) for x, y in zip(a, b)])
    gain = summarise([pages.gain(x, "retrieved", minus=(y, "retrieved")) for x, y in zip(a, b)])
    lower_nll = summarise([pages.per_target(np.asarray(y["nll_sum"]["retrieved"]) - np.asarray(x["nll_sum"]["retrieved"]),
                                            x["tokens"]) for x, y in zip(a, b)])
    return {"seeds": both, "updates": step, "delta": p["mean"], "ci95": p["ci95"], "ci95_seeds_t": p["ci95_seeds_t"],
            "by_seed": p["by_seed"], "shown": shown(p), "delta_retrieved_gain": gain,
            "retrieved_nll_lower_by": lower_nll}


def judge(arms: dict, contrasts: dict) -> dict:
    """The study's targets, each with the figure it is judged on. T2-T5 are judged on the chosen recipe's arms
    (`arms.RECIPE`): its loop without the auxiliary loss, its detached and frozen-TF-IDF twins, its pair with the
    auxiliary loss."""
    from experiments.mechanism.arms import RECIPE

    def verdict(name: str):
        c = contrasts.get(name)
        return None if c is None else c["shown"]

    out: dict = {"beta_f_trains_g_in_the_loop": verdict("beta_f_vs_detached_loop"),
                 "loop_adds_to_g_beyond_the_aux_loss": verdict("beta_f_beyond_aux"),
                 "recipe_arms": dict(RECIPE)}
    loop = arms.get(RECIPE["loop"])
    if loop:
        at_500 = loop["over_updates"].get("500", {}).get("p_at_1_over_init")
        if at_500:
            below = at_500["ci95"][1] < 0 and (at_500["ci95_seeds_t"] or [0, 0])[1] < 0
            out["T2_no_collapse_at_500"] = {"p_at_1_minus_init": at_500, "met": not below}
        end = loop["p_at_1_over_init"]
        out["T3_end_at_least_init_plus_0.10"] = {"p_at_1_minus_init": end, "met": end["mean"] >= 0.10 and shown(end)}
    pair = [contrasts.get(RECIPE[k]) for k in ("loop_vs_tfidf_frozen", "beta_f_beyond_aux")]
    out["T4_loop_adds_to_g"] = {"loop_vs_tfidf_frozen": pair[0] and {k: pair[0][k] for k in ("delta", "ci95",
                                                                                              "ci95_seeds_t", "shown")},
                                "beta_f_beyond_aux": pair[1] and {k: pair[1][k] for k in ("delta", "ci95",
                                                                                          "ci95_seeds_t", "shown")},
                                "met": bool(pair[0] and pair[1] and pair[0]["shown"] and pair[1]["shown"])}
    for name in dict.fromkeys(("loop", "loop_aux", RECIPE["loop"], RECIPE["aux"])):
        arm = arms.get(name)
        if not arm:
            continue
        versions = arm["aligned_link_precision"]
        start = next((v["mean"] for v in versions if v["version"] == 0), None)
        handed = [v for v in versions if v["version"] > 0 and not v["lexical_weight"]]
        out[f"{name}_index_precision_after_handover_at_least_tfidf_start"] = (
            all(v["mean"] >= start for v in handed) if handed and start is not None else None)
        out[f"{name}_index_precision"] = {"tfidf_start": start, "after_handover": [v["mean"] for v in handed]}
        if name == RECIPE["loop"] and handed and start is not None:
            out["T5_own_index_at_least_tfidf_start"] = {"tfidf_start": start, "last_own_version": handed[-1]["mean"],
                                                        "met": handed[-1]["mean"] >= start}
        for seed, longer in arm["extended"].items():
            out[f"{name}_seed_{seed}_to_{longer['updates']}_index_precision_after_handover"] = [
                v["precision"] for v in longer["aligned_link_precision"] if v["version"] > 0 and not v["lexical_weight"]]
    best = max((a for a in arms.values() if a), key=lambda a: a["p_at_1"]["mean"], default=None)
    if best:
        out["best_arm"] = next(k for k, a in arms.items() if a is best)
        out["best_arm_p_at_1"] = best["p_at_1"]["mean"]
        out["tfidf_p_at_1"] = best["p_at_1_tfidf"]
        out["best_g_at_least_tfidf"] = best["p_at_1"]["mean"] >= best["p_at_1_tfidf"]
    return out


def write_report(out: Path) -> dict:
    from experiments.mechanism.arms import ARM_NAMES, COMMON, CONTRASTS

    out = Path(out)
    runs = read_runs(out)
    if not runs:
        log.warning("%s holds no measured run yet", out)
        return {}
    pages = Pages(next(iter(next(iter(runs.values())).values()))["measures"])
    arms = {name: arm_summary(name, runs[name], pages) for name in [*ARM_NAMES, *sorted(set(runs) - set(ARM_NAMES))]
            if name in runs}
    arms = {k: v for k, v in arms.items() if v}
    contrasts = {}
    for name, (first, second, what) in CONTRASTS.items():
        if first in arms and second in arms:
            step = min(arms[first]["updates"], arms[second]["updates"])
            contrasts[name] = {"first": first, "second": second, "what": what,
                               **contrast(runs[first], runs[second], pages, step)}
    any_run = next(iter(next(iter(runs.values())).values()))
    heldout = {**(any_run["measures"].get("heldout") or {}), "pairs_own_page": own_page_pairs(pages.pair_pages)}
    if heldout["pairs_own_page"]:  # measures of a pairs file without groups: intervals narrower than over pages
        log.warning("%d held-out pairs have no known page and are resampled as pages of their own: the P@1 "
                    "intervals are narrower than over pages; prepare the corpus again to record each pair's group",
                    heldout["pairs_own_page"])
    report = {
        "question": "Does the reconstruction loss teach g to retrieve through beta * f, and does the loop add to g?",
        "common_overrides": list(COMMON),
        "heldout": heldout,
        "definitions": {
            "p_at_1": "held-out P@1 of g, mean over the tokenizer's directions of the held-out pairs; g centred on the "
                      "mean g of 2,048 training documents for every model (trained and initial alike)",
            "p_at_1_init": "the same measure of each seed's initial weights (one random init per seed)",
            "nll": "absolute NLL per held-out target token (text and EOS) at the last common update, mean over seeds, "
                   "by evidence condition (experiments/mechanism/measures.py)",
            "gains": "NLL(none) - NLL(condition) in nats per target token; 'retrieved' is the headline. 'none' is an "
                     "empty evidence document, which no training batch has: see gains_over_wrong_page",
            "gains_over_wrong_page": "NLL(wrong_page) - NLL(condition): against evidence of the same kind that is "
                                     "unrelated to the target",
            "ci95": "two-level bootstrap: seeds, then pages (2,000 draws); ci95_seeds_t: t interval over seed means",
            "contrast": "first arm minus second in g's P@1, paired by seed and item; shown = both intervals above 0; "
                        "retrieved_nll_lower_by: the second arm's NLL with its own retrieved evidence minus the "
                        "first's (positive: the first arm's own index and decoder do better)",
        },
        "arms": arms, "contrasts": contrasts, "targets": judge(arms, contrasts),
        "command": ("python -m experiments.mechanism run --out DIR --updates N --seeds 0,1,2 --jobs 2 "
                    f"--arms {','.join(arms)}"),
    }
    report["curves"] = plot_mechanism(report, out / "curves.png").name
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    return report


def plot_mechanism(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    colors = {name: f"C{i % 10}" for i, name in enumerate(arms)}
    styles = {True: "--", False: "-"}

    def curve(ax, key: str, title: str, hline=None):
        for name, arm in arms.items():
            steps = sorted(arm["over_updates"], key=int)
            x = [int(s) for s in steps]
            y = [arm["over_updates"][s][key]["mean"] for s in steps]
            lo = [arm["over_updates"][s][key]["ci95"][0] for s in steps]
            hi = [arm["over_updates"][s][key]["ci95"][1] for s in steps]
            ax.plot(x, y, styles[bool(arm.get("detached_f"))], color=colors[name], label=name, marker="o", markersize=3)
            ax.fill_between(x, lo, hi, color=colors[name], alpha=0.12)
        if hline is not None:
            ax.axhline(hline[0], color="k", linestyle=":", linewidth=1, label=hline[1])
        ax.set_title(title)
        ax.set_xlabel("update")
        ax.legend(fontsize=7)

    tfidf = next(iter(arms.values()))["p_at_1_tfidf"]
    curve(axes[0, 0], "p_at_1", "held-out P@1 of g (95% CI: seeds x pages; dashed: f detached)", (tfidf, "char TF-IDF"))
    curve(axes[0, 1], "gain_retrieved", "retrieved-evidence gain NLL(none) - NLL(retrieved), nats/token")
    curve(axes[0, 2], "retrieved_over_wrong_page", "retrieved evidence against another page's: NLL(wrong) - NLL(retr.)")
    ax = axes[1, 0]
    for name, arm in arms.items():
        v = arm["aligned_link_precision"]
        ax.plot([b["snapshot_step"] for b in v], [b["mean"] for b in v], "s" + styles[bool(arm.get("detached_f"))],
                color=colors[name], label=name, markersize=3)
    ax.set_title("index: cross-lingual links joining aligned translations (by snapshot)")
    ax.set_xlabel("snapshot update")
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    for name, arm in arms.items():
        steps = sorted(arm["over_updates"], key=int)
        ax.plot([int(s) for s in steps], [arm["over_updates"][s]["beta"] for s in steps],
                styles[bool(arm.get("detached_f"))], color=colors[name], label=name)
    ax.set_title("beta")
    ax.set_xlabel("update")
    ax.legend(fontsize=7)
    ax = axes[1, 2]
    conditions = list(next(iter(arms.values()))["nll"])
    width = 0.8 / max(1, len(arms))
    for i, (name, arm) in enumerate(arms.items()):
        ax.bar(np.arange(len(conditions)) + i * width, [arm["nll"][c] for c in conditions], width, color=colors[name],
               label=name)
    ax.set_xticks(np.arange(len(conditions)) + 0.4 - width / 2)
    ax.set_xticklabels(conditions, fontsize=8)
    low = min(arm["nll"][c] for arm in arms.values() for c in conditions)
    ax.set_ylim(low - 0.3, None)
    ax.set_title("held-out NLL per token at the last update, by evidence")
    ax.legend(fontsize=7)
    fig.suptitle("What teaches g to retrieve: arms at equal updates, seeds " +
                 ", ".join(str(s) for s in next(iter(arms.values()))["seeds"]))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
