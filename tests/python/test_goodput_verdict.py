"""The quickstart's last word: the rule of `scripts/govern-goodput.py`'s
verdict, on the figures of a healthy chain and of broken ones."""

import importlib.util
import pathlib

_path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "govern-goodput.py"
_spec = importlib.util.spec_from_file_location("govern_goodput", _path)
goodput = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(goodput)


def run(preemptions=0, in_ttft_slo=1.0, goodput_tok_s=0.0):
    return {"preemptions": preemptions, "in_ttft_slo": in_ttft_slo, "goodput_tok_s": goodput_tok_s}


# A profile swept in process states 100 output tok/s at the short bucket's
# safe point; this client, straight at the server over HTTP, reaches 84.
PROFILE, CEILING = 100.0, 84.0


def test_a_healthy_chain_beside_an_in_process_profile_passes():
    # The quickstart's run of 2026-12-06: 0.96 of the ceiling, 0.81 of the
    # profile, no preemptions, all within the TTFT SLO.
    healthy = [("safe", PROFILE, run(goodput_tok_s=0.97 * CEILING)),
               ("short", PROFILE, run(goodput_tok_s=0.96 * CEILING))]
    failed, reach = goodput.verdict(healthy, CEILING, PROFILE)
    assert failed == []
    assert abs(reach - 0.84) < 1e-9
    # Against the profile alone (the rule before), the same run missed.
    failed, _ = goodput.verdict(healthy, None, PROFILE)
    assert [f.split(" ")[0] for f in failed] == ["safe", "short"]


def test_preemptions_slo_misses_or_lost_goodput_fail_it():
    for broken, why in [
        (run(preemptions=3, goodput_tok_s=0.96 * CEILING), "3 preemptions"),
        (run(in_ttft_slo=0.9, goodput_tok_s=0.96 * CEILING), "90% within the TTFT SLO"),
        (run(goodput_tok_s=0.8 * CEILING), "goodput 0.80"),
    ]:
        failed, _ = goodput.verdict([("short", PROFILE, broken)], CEILING, PROFILE)
        assert len(failed) == 1 and why in failed[0], failed


def test_a_client_faster_than_the_profile_does_not_lower_the_bar():
    # A reach over 1 is taken as 1: the profile's own figure is the bar.
    failed, reach = goodput.verdict([("short", PROFILE, run(goodput_tok_s=85.0))], 150.0, PROFILE)
    assert reach == 1.0
    assert len(failed) == 1
