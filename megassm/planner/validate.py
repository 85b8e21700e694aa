"""The planner against every measured row (rows.py): the prediction, the measurement, the error (docs/planner.md)."""
from __future__ import annotations

import os
import statistics

from megassm.config import load_config
from megassm.planner.costs import Calibration, MissingCalibration, predict
from megassm.planner.rows import ROWS

__all__ = ["validate", "summary", "REPO", "layout_class", "class_errors"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def layout_class(cfg) -> str:
    """The family a layout's validation error is read from: engine, graphs or not, TP, PP, CP."""
    p, t = cfg.parallel, cfg.train
    eng = "fsdp2" if p.engine == "fsdp2" else ("deepspeed" if p.engine == "deepspeed" else "ddp")
    parts = [eng, "graphs" if t.cuda_graph else "eager"]
    if p.tp > 1:
        parts.append("tp")
    if p.pp > 1:
        parts.append("pp")
    if p.cp > 1:
        parts.append("cp")
    return " ".join(parts)


def class_errors(results: list[dict]) -> dict:
    """{layout class: (smallest, largest error)} over the validated rows with collectives (the rows measured with
    communication; a rank alone says nothing about the collectives' model)."""
    out: dict = {}
    for r in results:
        if r.get("error") is None or not r.get("comm", True):
            continue
        lo, hi = out.get(r["class"], (r["error"], r["error"]))
        out[r["class"]] = (min(lo, r["error"]), max(hi, r["error"]))
    return out


def validate(cal: Calibration, rows=ROWS) -> list[dict]:
    out = []
    for row in rows:
        cfg = load_config(os.path.join(REPO, row.config), ["data.builtin=stdlib", *row.overrides])
        try:
            p = predict(cfg, cal, comm=row.comm)
        except MissingCalibration as e:
            out.append(dict(name=row.name, measured=row.measured, predicted=None, error=None, why=str(e)))
            continue
        err = p.tokens_per_s_per_gpu / row.measured - 1.0
        out.append(dict(name=row.name, measured=row.measured, predicted=round(p.tokens_per_s_per_gpu, 1),
                        error=round(err, 4), mfu=p.mfu, best_of=row.best_of, source=row.source, date=row.date,
                        notes=row.notes, exposed_comm_s=round(p.exposed_comm_s, 4), step_s=round(p.step_s, 4),
                        comm=row.comm, **{"class": layout_class(cfg)}))
    return out


def summary(results: list[dict]) -> dict:
    errs = [abs(r["error"]) for r in results if r["error"] is not None]
    groups = {}
    for r in results:
        if r.get("best_of"):
            groups.setdefault(r["best_of"], []).append(r)
    ranking = {}
    for g, rs in groups.items():
        best_measured = max(rs, key=lambda r: r["measured"])["name"]
        best_predicted = max(rs, key=lambda r: r["predicted"] or 0)["name"]
        ranking[g] = {"measured_best": best_measured, "predicted_best": best_predicted,
                      "ok": best_measured == best_predicted}
    return {"rows": len(results), "predicted": len(errs), "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None, "within_25pct": sum(e <= 0.25 for e in errs),
            "ranking": ranking}
