import math

import pytest
import torch

from edurl.llm import losses as L
from edurl.llm.length_bias import (
    LengthBiasConfig,
    completion_logprobs,
    expected_length,
    length_bias_run,
    length_bias_study,
    plot_length_bias,
    sample_completions,
)


def logit(p):
    return torch.tensor(math.log(p / (1 - p)), dtype=torch.float64)


def test_expected_length_by_hand():
    # p = 0.5, max 3 tokens: answer, then stop (L=2) w.p. 0.5, else filler and cut at 3: 0.5*2 + 0.5*3 = 2.5
    assert expected_length(logit(0.5), 3).item() == pytest.approx(2.5)
    # max 2 tokens: always answer + one more token
    assert expected_length(logit(0.9), 2).item() == pytest.approx(2.0)
    # no cut that matters: 1 + 1/p
    assert expected_length(logit(0.25), 200).item() == pytest.approx(1 + 4, rel=1e-9)
    # one value per stop logit
    both = expected_length(torch.stack([logit(0.5), logit(0.25)]), 3)
    assert torch.allclose(both, torch.tensor([2.5, 1 + 1 + 0.75], dtype=torch.float64))


def test_sampled_lengths_follow_the_policy():
    g = torch.Generator().manual_seed(0)
    stop = torch.stack([logit(0.2), logit(0.6)])  # [wrong, right]
    right, lengths, stopped = sample_completions(logit(0.3), stop, 200_000, 16, g)
    assert right.double().mean().item() == pytest.approx(0.3, abs=0.005)
    expected = expected_length(stop, 16)
    assert lengths[~right].double().mean().item() == pytest.approx(expected[0].item(), abs=0.05)
    assert lengths[right].double().mean().item() == pytest.approx(expected[1].item(), abs=0.02)
    assert lengths.min() >= 2 and lengths.max() == 16
    # cut at max_tokens without a stop token: (1 - p)^(max_tokens - 1) of the wrong ones
    assert (~stopped[~right]).double().mean().item() == pytest.approx(0.8**15, abs=0.005)
    assert stopped[lengths < 16].all()


def test_a_stop_probability_too_small_for_int64_cuts_at_max_tokens():
    # p = sigmoid(-50) ~ 2e-22: log U / log(1 - p) is ~1e21 fillers, more than an int64 holds; the cast once wrapped
    # to -9.2e18, a negative length marked as stopped
    g = torch.Generator().manual_seed(0)
    stop = torch.tensor([-50.0, -800.0], dtype=torch.float64)  # sigmoid(-800) is exactly 0: inf fillers
    for answer in (-30.0, 30.0):  # all wrong, then all right: each stop logit in turn
        right, lengths, stopped = sample_completions(torch.tensor(answer, dtype=torch.float64), stop, 50, 16, g)
        assert lengths.tolist() == [16] * 50 and not stopped.any()


def test_completion_logprobs_by_hand():
    a, stop = logit(0.3), torch.stack([logit(0.2), logit(0.6)])
    right = torch.tensor([True, False, False])
    lengths = torch.tensor([3, 2, 4])
    stopped = torch.tensor([True, True, False])  # the third was cut at max_tokens = 4
    lp, mask = completion_logprobs(a, stop, right, lengths, stopped, 4)
    ln = math.log
    expected = [
        [ln(0.3), ln(0.4), ln(0.6)],  # right, one filler, stop
        [ln(0.7), ln(0.2)],  # wrong, stop at once
        [ln(0.7), ln(0.8), ln(0.8), ln(0.8)],  # wrong, three fillers, cut
    ]
    for row, want in enumerate(expected):
        assert mask[row].sum().item() == len(want)
        assert torch.allclose(lp[row, : len(want)], torch.tensor(want, dtype=torch.float64))


def test_grpo_aggregation_grows_wrong_answers_and_dr_grpo_does_not():
    """The effect the chapter asserts over 10 seeds, here on three: under seq_mean_token_mean a wrong
    completion's expected length more than doubles and a right one's shrinks; with Dr. GRPO's constant
    divisor neither moves much."""
    for seed in range(3):
        grpo = length_bias_run(LengthBiasConfig(aggregation="seq_mean_token_mean", seed=seed))
        dr = length_bias_run(LengthBiasConfig(aggregation="seq_mean_token_sum_norm", seed=seed))
        start = grpo["length/wrong"].iloc[0]
        assert dr["length/wrong"].iloc[0] == start
        assert grpo["length/wrong"].iloc[-1] > 2.5 * start
        assert grpo["length/right"].iloc[-1] < 0.65 * start
        assert grpo["length/wrong"].iloc[-1] > 1.5 * dr["length/wrong"].iloc[-1]
        assert 0.5 * start < dr["length/right"].iloc[-1] < 2 * start
        # both learn the answer
        assert grpo["p_right"].iloc[-1] > 0.8 and dr["p_right"].iloc[-1] > 0.8


def test_the_run_uses_the_librarys_aggregation(monkeypatch):
    """A broken aggregate shows up in the run: with every mode replaced by token_mean, GRPO's bias is gone."""
    real = L.aggregate
    monkeypatch.setattr(L, "aggregate", lambda loss, mask, mode, max_tokens=None: real(loss, mask, "token_mean"))
    run = length_bias_run(LengthBiasConfig(aggregation="seq_mean_token_mean", seed=0, steps=60))
    assert run["length/wrong"].iloc[-1] < 2 * run["length/wrong"].iloc[0]


def test_study_and_plot():
    study = length_bias_study(("sum", "token_mean"), seeds=[0, 1], progress=False, steps=5)
    assert len(study) == 2 * 2 * 6
    assert set(study.aggregation) == {"sum", "token_mean"} and set(study.seed) == {0, 1}
    assert set(study.step) == set(range(6))
    axes = plot_length_bias(study)
    assert len(axes) == 4 and len(axes[0].lines) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"aggregation": "mean"}, "aggregation must be one of"),
        ({"group_size": 1}, "group_size must be >= 2"),
        ({"steps": 0}, "steps must be a positive int"),
        ({"max_tokens": 1}, "max_tokens must be >= 2"),
        ({"p_stop": 1.0}, "p_stop must be a probability"),
        ({"learning_rate": float("nan")}, "learning_rate must be"),
    ],
)
def test_config_errors_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LengthBiasConfig(**kwargs)
