"""The mechanism study's report as Markdown tables (`python -m experiments.mechanism tables --out DIR`): what
experiments/mechanism/README.md quotes, printed from report.json so that no figure is copied by hand."""

from __future__ import annotations

import json
from pathlib import Path


def interval(summary: dict | None, digits: int = 3) -> str:
    """'mean (bootstrap lo to hi; t lo to hi)' of a report summary."""
    if not summary:
        return "–"
    lo, hi = summary["ci95"]
    t = summary.get("ci95_seeds_t")
    seeds = f"; {t[0]:.{digits}f} to {t[1]:.{digits}f}" if t else ""
    return f"{summary['mean']:+.{digits}f} ({lo:.{digits}f} to {hi:.{digits}f}{seeds})"


def plain(summary: dict | None, digits: int = 3) -> str:
    return interval(summary, digits).lstrip("+")


def arms_table(report: dict) -> str:
    rows = ["| arm | lever | aux loss | f | P@1 of g (95% CI; t over seeds) | its inits | trained − init | "
            "at update 500 − init | β | β's rise / Adam's most, last span |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, arm in report["arms"].items():
        at_500 = arm["over_updates"].get("500", {}).get("p_at_1_over_init")
        spans = arm.get("beta_over_adam_max") or {}
        last_span = spans[list(spans)[-1]]["mean"] if spans else None
        rows.append(f"| `{name}` | {arm.get('lever') or '–'} | {'yes' if arm['aux_loss'] else 'no'} | "
                    f"{'detached' if arm['detached_f'] else 'trained'} | {plain(arm['p_at_1'])} | "
                    f"{arm['p_at_1_init']['mean']:.3f} | {interval(arm['p_at_1_over_init'])} | {interval(at_500)} | "
                    f"{arm['beta']:.2f} | {'–' if last_span is None else f'{last_span:.2f}'} |")
    return "\n".join(rows)


def contrasts_table(report: dict) -> str:
    rows = ["| contrast | Δ P@1 | 95% CI (seeds × pages) | t over seeds | by seed | shown |",
            "|---|---|---|---|---|---|"]
    for name, c in report["contrasts"].items():
        t = c["ci95_seeds_t"]
        rows.append(f"| `{name}` ({c['first']} − {c['second']}) | {c['delta']:+.3f} | {c['ci95'][0]:.3f} to "
                    f"{c['ci95'][1]:.3f} | {'–' if not t else f'{t[0]:.3f} to {t[1]:.3f}'} | "
                    f"{', '.join(f'{x:+.3f}' for x in c['by_seed'])} | {'yes' if c['shown'] else 'no'} |")
    return "\n".join(rows)


def curves_table(report: dict) -> str:
    """P@1 of g over updates, and the figures measured beside it."""
    steps = sorted({int(s) for arm in report["arms"].values() for s in arm["over_updates"]})
    rows = ["| arm | " + " | ".join(f"P@1 at {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for name, arm in report["arms"].items():
        cells = [f"{arm['over_updates'][str(s)]['p_at_1']['mean']:.3f}" if str(s) in arm["over_updates"] else "–"
                 for s in steps]
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def mechanism_table(report: dict) -> str:
    """Per arm at its last update: the f share of g's gradient (mean over the snapshots of the last 500 updates),
    the headroom, and whether the decoder's unbiased reading and f prefer gold translations."""
    rows = ["| arm | f share of g's gradient (embedding; layers) | NLL retrieved − gold | NLL wrong page − retrieved | "
            "reading prefers gold | f prefers gold |", "|---|---|---|---|---|---|"]
    for name, arm in report["arms"].items():
        last = str(arm["updates"])
        shares = arm.get("f_gradient_share") or {}

        def recent(figure: str) -> str:
            values = [v["mean"] for k, v in (shares.get(figure) or {}).items() if int(k) > arm["updates"] - 500]
            return f"{sum(values) / len(values):.4f}" if values else "–"

        over = arm["over_updates"][last]
        rows.append(f"| `{name}` | {recent('f_gradient_share')} ({recent('f_gradient_share_embedding')}; "
                    f"{recent('f_gradient_share_layers')}) | {interval(arm['headroom'][last]['retrieved_minus_gold'])} | "
                    f"{interval(arm['headroom'][last]['wrong_page_minus_retrieved'])} | "
                    f"{plain(over.get('reading_top_is_gold'))} | {plain(over.get('f_top_is_gold'))} |")
    return "\n".join(rows)


def index_table(report: dict) -> str:
    """Per arm, the share of its index versions' cross-lingual links that join aligned translations: the first
    version, and the first and last of the versions ranked by g alone (lambda 0), by the snapshot they come from."""
    rows = ["| arm | first version (its source) | first version ranked by g alone | last version ranked by g alone |",
            "|---|---|---|---|"]
    for name, arm in report["arms"].items():
        versions = arm["aligned_link_precision"]
        if not versions:
            continue
        first = versions[0]
        own = [v for v in versions if v["version"] > 0 and not v["lexical_weight"]]

        def at(v: dict | None) -> str:
            return "–" if v is None else f"{v['mean']:.3f} (snapshot {v['snapshot_step']})"

        rows.append(f"| `{name}` | {first['mean']:.3f} ({', '.join(first['link_sources'])}) | "
                    f"{at(own[0] if own else None)} | {at(own[-1] if own else None)} |")
    return "\n".join(rows)


TABLES = (("arms", arms_table), ("contrasts", contrasts_table), ("P@1 over updates", curves_table),
          ("where g's gradient comes from, and the evidence", mechanism_table), ("g's own index", index_table))


def markdown_tables(report: dict) -> str:
    return "\n".join(f"### {title}\n\n{table(report)}\n" for title, table in TABLES)


def print_tables(out: Path) -> None:
    print(markdown_tables(json.loads((Path(out) / "report.json").read_text(encoding="utf-8"))))
