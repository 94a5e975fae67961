"""Off the policy the Fisher under p (d_model directions per position), which only rho needs, is
computed only when asked: the analysis without it has every other statistic, the same; the analysis with
it (``rho``, or ``POST /analyses/{id}/rho``) adds rho; the cost estimate counts the directions each runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from backend.cost import backward_directions, probe_directions
from backend.settings import Settings
from backend.vocabulary import STATS, Method, Sampler
from tests.test_engine import _job, _token, run_analysis
from tests.test_redis_e2e import wait_done
from workers.fisher.stats import RhoNotComputed
from workers.serve import embedded_api

OFF_POLICY = Sampler(temperature=0.7, top_k=5)
WITHOUT_RHO = tuple(stat for stat in STATS if stat != "rho")


def _pair(loaded, continuation: str = "", between=lambda: None):
    """The off-policy analysis without rho and with it, on the same request otherwise (``between()``
    runs after the first)."""
    reward = {str(_token(loaded, " tea")): 1.0}
    job = _job(loaded, continuation=continuation, sampler=OFF_POLICY, reward=reward)
    without = run_analysis(loaded, job)
    between()
    return without, run_analysis(loaded, job.model_copy(update={"rho": True}))


@pytest.mark.parametrize("continuation", ["", " coffee and"])
def test_without_rho_every_other_stat_is_the_same_and_rho_is_absent(tiny_random, continuation, monkeypatch):
    from workers.fisher import position

    counted = [0]  # square directions back-propagated, per analysis
    backprop = position.backprop_directions

    def counting(capture, at, squares, *args, **kwargs):
        counted[-1] += sum(len(group.weights) for group in squares)
        return backprop(capture, at, squares, *args, **kwargs)

    monkeypatch.setattr(position, "backprop_directions", counting)
    without, with_rho = _pair(tiny_random, continuation, between=lambda: counted.append(0))
    assert without.summary["rho_available"] is False and with_rho.summary["rho_available"] is True
    for stat in WITHOUT_RHO:
        a, b = without.per_parameter(stat), with_rho.per_parameter(stat)
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-9, msg=f"{stat} {name}")
    assert without.summary["totals"]["rho_mean"] is None
    assert all(t["totals"]["rho_mean"] is None for t in without.summary["tensors"])
    assert all(g["totals"]["rho_mean"] is None for g in without.summary["layers"] + without.summary["kinds"])
    assert 0 < with_rho.summary["totals"]["rho_mean"] <= 1
    for key in ("fisher", "uncentered", "raw", "mean_shift_sq", "policy_grad_sq", "bound"):
        assert without.summary["totals"][key] == pytest.approx(with_rho.summary["totals"][key], rel=1e-5)
    assert without.stats == WITHOUT_RHO and with_rho.stats == STATS
    assert "rho" not in without.pooled(8, 8) and "rho" in with_rho.pooled(8, 8)
    with pytest.raises(RhoNotComputed, match="rho needs the Fisher under p"):
        without.per_parameter("rho")
    # the directions each ran: the Fisher under mu's only (top-k 5: rank 4), against those plus the
    # d_model under p, at every position
    positions = len(without.summary["positions"])
    assert counted == [4 * positions, (4 + tiny_random.info.d_model) * positions]


def test_monte_carlo_draws_the_same_samples_with_rho_or_without(tiny_random):
    """The draws are seeded by the request without its rho: the rho stage's other numbers are the first's."""
    job = _job(tiny_random, sampler=OFF_POLICY, method=Method.parse("mc:4"))
    without = run_analysis(tiny_random, job)
    with_rho = run_analysis(tiny_random, job.model_copy(update={"rho": True}))
    for stat in WITHOUT_RHO:
        a, b = without.per_parameter(stat), with_rho.per_parameter(stat)
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-9, msg=f"{stat} {name}")


def test_a_saved_file_without_rho_holds_every_other_stat(tiny_random, tmp_path: Path):
    from safetensors.torch import load_file

    without, _ = _pair(tiny_random)
    without.save(tmp_path / "a.safetensors")
    stats = {key.split("/")[0] for key in load_file(tmp_path / "a.safetensors") if "/" in key}
    assert stats == set(WITHOUT_RHO)


def test_on_the_policy_rho_is_free_and_asking_for_it_changes_nothing(tiny_random):
    job = _job(tiny_random)
    summary = run_analysis(tiny_random, job).summary
    assert summary["rho_available"] is True and summary["totals"]["rho_mean"] is not None


def test_the_estimate_counts_the_directions_under_p_only_when_asked(tiny_random):
    info = tiny_random.info
    job = _job(tiny_random, sampler=OFF_POLICY)
    asked = job.model_copy(update={"rho": True})
    assert backward_directions(info, asked) - backward_directions(info, job) == info.d_model
    tied = type("Tied", (), {"d_model": info.d_model, "tied_embeddings": True})()
    assert [
        2 * n for n in probe_directions(tied, job.model_copy(update={"method": Method.parse("mc:4")}))
    ] == probe_directions(tied, asked.model_copy(update={"method": Method.parse("mc:4")}))


def test_the_api_answers_rho_as_a_second_analysis(tmp_path: Path):
    client = TestClient(embedded_api(Settings(results_dir=tmp_path / "r", exports_dir=tmp_path / "e")))
    body = {
        "model": "tiny-random",
        "prefix": "She drank a cup of",
        "sampler": {"temperature": 0.7, "top_k": 5},
    }
    first = wait_done(client, client.post("/api/v1/analyses", json=body).json()["id"])
    assert first["status"] == "done" and first["result"]["rho_available"] is False
    assert first["request"]["rho"] is False
    tensor = first["result"]["tensors"][0]["name"]
    refused = client.get(f"/api/v1/analyses/{first['id']}/tensors/{tensor}", params={"stat": "rho"})
    assert refused.status_code == 409 and f"/api/v1/analyses/{first['id']}/rho" in refused.json()["detail"]
    export = client.get(f"/api/v1/analyses/{first['id']}/safetensors", params={"stats": "fisher,rho"})
    assert export.status_code == 422 and "rho needs the Fisher under p" in export.json()["detail"]

    asked = client.post(f"/api/v1/analyses/{first['id']}/rho")
    assert asked.status_code in (200, 202) and asked.json()["id"] != first["id"]
    second = wait_done(client, asked.json()["id"])
    assert second["status"] == "done" and second["result"]["rho_available"] is True
    assert second["request"] == {**first["request"], "rho": True}
    assert (
        client.get(f"/api/v1/analyses/{second['id']}/tensors/{tensor}", params={"stat": "rho"}).status_code
        == 200
    )
    # asking again is the cache; asking the rho analysis (or an on-policy one) answers itself
    assert client.post(f"/api/v1/analyses/{first['id']}/rho").json()["id"] == second["id"]
    again = client.post(f"/api/v1/analyses/{second['id']}/rho")
    assert again.status_code == 200 and again.json()["id"] == second["id"]
    same = client.post("/api/v1/analyses", json={**body, "rho": True})
    assert same.status_code == 200 and same.json()["id"] == second["id"]
    on_policy = {"model": "tiny-random", "prefix": "She drank a cup of"}
    plain = wait_done(client, client.post("/api/v1/analyses", json=on_policy).json()["id"])
    assert plain["result"]["rho_available"] is True
    assert client.post(f"/api/v1/analyses/{plain['id']}/rho").json()["id"] == plain["id"]
    assert client.post("/api/v1/analyses", json={**on_policy, "rho": True}).json()["id"] == plain["id"]
    # a response still to be sampled: its rho request draws the same response (the seed is in the request)
    sampled = {**body, "continuation_sample": {"seed": 3, "max_tokens": 2}}
    first_sampled = client.post("/api/v1/analyses", json=sampled).json()["id"]
    staged = client.post(f"/api/v1/analyses/{first_sampled}/rho").json()
    assert staged["request"]["rho"] is True
    drawn = wait_done(client, first_sampled)
    staged = wait_done(client, staged["id"])
    assert staged["request"]["continuation_ids"] == drawn["request"]["continuation_ids"]
    assert staged["result"]["rho_available"] is True and drawn["result"]["rho_available"] is False
    missing = client.post(f"/api/v1/analyses/{'0' * 64}/rho")
    assert missing.status_code == 404 and "POST /api/v1/analyses first" in missing.json()["detail"]
