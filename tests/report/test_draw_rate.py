"""The run page's eval curves show the draw rate against an opponent that can be drawn (minimax)."""
from unstable_dask.report.report import curve_charts

KEYS = ["win_rate_low", "win_rate_high", "invalid_rate", "invalid_rate_low", "invalid_rate_high", "format_success",
        "format_success_low", "format_success_high", "mean_completion_tokens", "mu", "sigma", "conservative"]


def _row(round_, opponent, wins, draws, losses):
    n = wins + draws + losses
    return dict.fromkeys(KEYS) | dict(round=round_, split="eval", opponent=opponent, wins=wins, draws=draws,
                                      losses=losses, win_rate=(wins + draws / 2) / n)


def test_draw_rate_curve_per_opponent_with_draws():
    rows = [_row(0, "minimax", 0, 1, 3), _row(1, "minimax", 0, 4, 0), _row(0, "random", 3, 0, 1), _row(1, "random", 4, 0, 0)]
    charts = curve_charts(rows)
    title = next(t for t in charts if t.startswith("Eval draw rate"))
    values = sorted((v["x"], v["series"], v["y"]) for v in charts[title]["datasets"]["rows"])
    assert values == [(0, "vs minimax", 0.25), (1, "vs minimax", 1.0)]  # random is never drawn: no curve
    assert not any(t.startswith("Eval draw rate") for t in curve_charts([r for r in rows if r["opponent"] == "random"]))
