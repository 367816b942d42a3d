"""benchmarks/grpo_step_profile.py's replay of forward_backward (issue 19), on the small model of these tests."""


def test_grpo_step_profile_replays_forward_backward_in_each_zero_advantage_mode(small_model, char_tokenizer, capsys):
    """``--replay-zero-advantage``: each recorded call runs again from the weights it saw, once per mode."""
    import torch

    from edurl.llm import ServiceClient, build_datum

    from ..test_benchmark_scripts import _benchmark

    profile = _benchmark("grpo_step_profile")
    trainer = ServiceClient(device="cpu").create_training_client((small_model, char_tokenizer))
    datums = [build_datum([3, 5, 7], [9, 11], [-1.0, -2.0], a) for a in (1.0, -1.0, 0.0, 0.0)]
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    seen = []
    real = type(trainer).forward_backward

    def spy(self, *args, **kwargs):
        seen.append((self.skip_zero_advantage, self.score_zero_advantage, next(self.model.parameters()).sum().item()))
        return real(self, *args, **kwargs)

    type(trainer).forward_backward = spy
    try:
        with torch.no_grad():
            next(trainer.model.parameters()).add_(1.0)  # the replay must put the recorded weights back
        profile.replay_zero_advantage([(trainer, weights, datums, ("importance_sampling",), {})], 2, 1)
    finally:
        type(trainer).forward_backward = real
    assert sorted({mode[:2] for mode in seen}) == sorted(profile.MODES.values()) and len(seen) == 6
    assert {round(s, 4) for *_, s in seen} == {round(weights[0].sum().item(), 4)}
    out = capsys.readouterr().out
    assert all(name in out for name in profile.MODES) and "1.00x" in out


def test_grpo_step_profile_trains_in_a_folder_of_its_own(monkeypatch):
    """It trained in the recipe's default log_dir, runs/grpo_arithmetic: it replaced a learner's metrics there, or
    failed on the learner's checkpoints with advice (--resume, --overwrite) that the script has no flags for."""
    import sys
    from pathlib import Path

    import pytest

    from ..test_benchmark_scripts import _benchmark

    profile = _benchmark("grpo_step_profile")
    seen = []

    class Stop(Exception):
        pass

    def fake_train(config):
        seen.append(config)
        raise Stop

    monkeypatch.setattr(profile, "train_grpo", fake_train)
    monkeypatch.setattr(sys, "argv", ["grpo_step_profile.py", "--steps", "2"])
    with pytest.raises(Stop):
        profile.main()
    (config,) = seen
    assert Path(config.log_dir).name.startswith("grpo-step-profile-") and config.save_every == 0
    assert not Path(config.log_dir).exists()  # a temporary folder, gone afterwards
