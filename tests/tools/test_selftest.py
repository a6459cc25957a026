"""``cudnn_attn.selftest`` / ``cudnn-attn selftest``: it passes a correct engine on this machine,
and it notices when an engine is wrong (each mutation below must turn its verdict to FAIL)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import cudnn_attn
from cudnn_attn import cli
from cudnn_attn.model.inputs import DropoutState
from cudnn_attn.torch_engine.backend import TorchBackend, TorchPlan
from cudnn_attn.verify import Case, grid, selftest
from cudnn_attn.verify.checks import run_case

from oracle import aligned_offsets, build_visibility, default_alibi_slopes, reference_attention

FEATURES = ("dense", "causal", "sliding window", "padding", "alibi", "tensor bias", "softcap",
            "dropout", "GQA/MQA", "D_v != D_qk", "odd sizes", "varlen", "paged KV",
            "neighborhood 1-D", "neighborhood 2-D", "neighborhood 3-D", "neighborhood RPB",
            "head dims")


@pytest.fixture(autouse=True)
def _fresh_caches():
    cudnn_attn.clear_caches()
    yield
    cudnn_attn.clear_caches()


def _one(name: str) -> Case:
    return next(c for c in grid(quick=True) if c.name == name)


def test_quick_grid_passes_on_the_torch_engine_and_covers_every_feature(tmp_path):
    report = selftest(backends=["torch"], quick=True, progress=False)
    assert report.ok, report.table()
    assert {o.case.feature for o in report.outcomes} == set(FEATURES)
    assert {o.dtype for o in report.outcomes} == {"float32", "bfloat16"}
    assert all(o.backward in ("pass", "n/a") for o in report.outcomes)
    path = tmp_path / "selftest.json"
    report.to_json(path)
    data = json.loads(path.read_text())
    assert data["ok"] and data["counts"]["pass"] == len(report.outcomes)
    assert {r["case"] for r in data["results"]} == {c.name for c in grid(quick=True)}
    assert data["environment"]["torch"] == torch.__version__
    assert data["table"] == report.table()  # what the run printed travels with the record


def test_full_grid_adds_head_dims_and_larger_problems():
    quick, full = grid(quick=True), grid(quick=False)
    dims = {c.dim_qk for c in full if c.feature == "head dims"}
    assert dims == set(range(32, 257, 32))
    assert len(full) > len(quick) and any(c.name.endswith("-large") for c in full)


def test_the_oracle_agrees_with_the_test_suites_independent_oracle():
    # The selftest's oracle vs tests/oracle.py (a separate float64 brute force) on a padded,
    # bottom-right causal ALiBi problem with an empty query row.
    from cudnn_attn.verify import oracle

    lens_q, lens_kv = (9, 0), (13, 6)
    case = Case("x", "x", batch=2, heads_q=4, heads_kv=4, seq_q=9, seq_kv=13, dim_qk=8, dim_v=8,
                mask=(("padding", lens_q, lens_kv), ("causal", "bottom_right")), bias="alibi")
    q, k, v = (torch.randn(2, 4, s, 8, dtype=torch.float64) for s in (9, 13, 13))
    out, lse = oracle.reference(case, q, k, v, scale=0.3)
    vis = build_visibility(2, 9, 13, causal="bottom_right", seq_lens_q=lens_q,
                           seq_lens_kv=lens_kv)
    offsets = aligned_offsets(2, 9, 13, "bottom_right", lens_q, lens_kv)
    want, want_lse = reference_attention(q, k, v, vis, scale=0.3, alibi_offsets=offsets,
                                         alibi_slopes=default_alibi_slopes(4))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=0, atol=1e-12)


def _mutate(monkeypatch, direction: str, change):
    """Wrap the torch engine's forward or backward so that ``change`` alters its result."""
    original = getattr(TorchPlan, direction)

    def wrapped(self, *args, **kwargs):
        return change(original(self, *args, **kwargs))

    monkeypatch.setattr(TorchPlan, direction, wrapped)


CASES = ("dense", "padding-empty-rows", "na2d-stride-dilation-causal", "varlen", "alibi")


@pytest.mark.parametrize("name", CASES)
def test_a_slightly_wrong_output_fails(monkeypatch, name):
    _mutate(monkeypatch, "forward", lambda r: (r[0] * 1.01, r[1]))
    outcome = run_case(_one(name), "torch", torch.float32, torch.device("cpu"))
    assert outcome.status == "FAIL" and outcome.forward == "FAIL", outcome.detail


def test_a_wrong_lse_fails(monkeypatch):
    _mutate(monkeypatch, "forward", lambda r: (r[0], r[1] + 1e-3))
    outcome = run_case(_one("causal-top-left"), "torch", torch.float32, torch.device("cpu"))
    assert outcome.forward == "FAIL", outcome.detail


def test_a_finite_lse_on_an_empty_row_fails(monkeypatch):
    _mutate(monkeypatch, "forward", lambda r: (r[0], r[1].nan_to_num(neginf=0.0)))
    outcome = run_case(_one("padding-empty-rows"), "torch", torch.float32, torch.device("cpu"))
    assert outcome.forward == "FAIL" and "-inf" in outcome.detail[0]


def test_a_nan_in_the_output_fails(monkeypatch):
    def poison(r):
        out = r[0].clone()
        out.view(-1)[3] = math.nan
        return out, r[1]
    _mutate(monkeypatch, "forward", poison)
    outcome = run_case(_one("dense"), "torch", torch.float32, torch.device("cpu"))
    assert outcome.forward == "FAIL" and "non-finite" in outcome.detail[0]


@pytest.mark.parametrize("index, name", [(0, "dq"), (1, "dk"), (2, "dv")])
def test_a_slightly_wrong_gradient_fails(monkeypatch, index, name):
    def change(grads):
        grads = list(grads)
        grads[index] = grads[index] * 1.02
        return tuple(grads)
    _mutate(monkeypatch, "backward", change)
    outcome = run_case(_one("mqa"), "torch", torch.float32, torch.device("cpu"))
    assert outcome.forward == "pass" and outcome.backward == "FAIL", outcome.detail
    assert name in outcome.detail[0]


def test_a_wrong_bias_gradient_fails(monkeypatch):
    _mutate(monkeypatch, "backward", lambda g: (*g[:3], g[3] * 1.05))
    outcome = run_case(_one("bias"), "torch", torch.float32, torch.device("cpu"))
    assert outcome.backward == "FAIL" and "dbias" in outcome.detail[0]


def test_a_non_repeatable_forward_fails(monkeypatch):
    _mutate(monkeypatch, "forward",
            lambda r: (r[0] + 1e-7 * torch.randn_like(r[0]), r[1]))
    outcome = run_case(_one("dense"), "torch", torch.float32, torch.device("cpu"))
    assert outcome.forward == "FAIL" and "repeatable" in " ".join(outcome.detail)


def test_dropout_that_ignores_the_generator_fails(monkeypatch):
    monkeypatch.setattr(DropoutState, "draw", staticmethod(
        lambda generator=None: DropoutState(int(torch.randint(0, 2**31, (1,))), 0)))
    outcome = run_case(_one("dropout"), "torch", torch.float32, torch.device("cpu"))
    assert outcome.forward == "FAIL" and "replay" in " ".join(outcome.detail)


def test_dropout_without_rescaling_fails(monkeypatch):
    case = _one("dropout")
    _mutate(monkeypatch, "forward", lambda r: (r[0] * (1 - case.dropout_p), r[1]))
    outcome = run_case(case, "torch", torch.float32, torch.device("cpu"))
    assert outcome.forward == "FAIL", outcome.detail


def test_dropout_backward_with_another_mask_fails(monkeypatch):
    _mutate(monkeypatch, "backward", lambda g: (g[0], g[1], g[2].flip(-2), g[3]))
    outcome = run_case(_one("dropout"), "torch", torch.float32, torch.device("cpu"))
    assert outcome.forward == "pass" and outcome.backward == "FAIL", outcome.detail


def test_a_decline_is_listed_with_its_reason_not_failed(monkeypatch):
    original = TorchBackend.supports

    def supports(self, problem):
        reasons = original(self, problem)
        return reasons + (["softcap is not for today"] if problem.softcap else [])
    monkeypatch.setattr(TorchBackend, "supports", supports)
    report = selftest(backends=["torch"], dtypes=["float32"], progress=False,
                      cases=[_one("softcap"), _one("dense")])
    assert report.ok
    assert [o.status for o in report.outcomes] == ["declined", "pass"]
    assert "softcap is not for today" in report.table()


def test_an_engine_that_cannot_run_here_is_listed(monkeypatch):
    monkeypatch.setattr(TorchBackend, "availability", lambda self: ["pretend no torch"])
    listed = selftest(dtypes=["float32"], progress=False, cases=[_one("dense")])
    assert not listed.outcomes and listed.ok and "pretend no torch" in listed.table()
    named = selftest(backends=["torch"], dtypes=["float32"], progress=False, cases=[_one("dense")])
    assert not named.ok and "requested" in named.table()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="backends"):
        selftest(backends=["tensorrt"], progress=False)
    with pytest.raises(ValueError, match="dtypes"):
        selftest(dtypes=["float8"], progress=False)


def test_cudnn_attn_selftest_is_the_function():
    assert cudnn_attn.selftest is selftest


def test_command_line_table_json_and_exit_status(tmp_path, capsys, monkeypatch):
    path = tmp_path / "st.json"
    code = cli.main(["selftest", "--backend", "torch", "--dtype", "float32", "--no-progress",
                     "--json", str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "neighborhood 3-D" in out and "passed, 0 failed" in out
    assert json.loads(path.read_text())["ok"]
    # The mutation lives in this process: --one-process judges the engine here, not in a child.
    _mutate(monkeypatch, "forward", lambda r: (r[0] * 1.01, r[1]))
    code = cli.main(["selftest", "--backend", "torch", "--dtype", "float32", "--no-progress",
                     "--one-process"])
    assert code == 1 and "FAIL" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        cli.main(["selftest", "--dtype", "float8"])
    assert bad.value.code == 2
