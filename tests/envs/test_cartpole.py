import gymnasium as gym
import numpy as np
import pytest
import torch

from edurl.envs import TorchCartPole


def test_matches_gymnasium_step_for_step_in_float64():
    """10,000 random-action steps over 4 envs, resets included: observations, rewards and both flags agree."""
    n, steps = 4, 10_000
    gyms = [gym.make("CartPole-v1") for _ in range(n)]
    ours = TorchCartPole(n, dtype=torch.float64)
    ours.reset(seed=0)
    for i, env in enumerate(gyms):
        env.reset(seed=i)
        ours.state[i] = torch.as_tensor(env.unwrapped.state)  # identical starting states
    rng = np.random.default_rng(0)
    ends = 0
    for _ in range(steps // n):
        actions = rng.integers(0, 2, size=n)
        obs, reward, terminated, truncated, info = ours.step(torch.as_tensor(actions))
        for i, env in enumerate(gyms):
            _, g_rew, g_term, g_trunc, _ = env.step(int(actions[i]))
            g_state = torch.as_tensor(env.unwrapped.state)
            torch.testing.assert_close(info["final_obs"][i], g_state, rtol=0, atol=1e-10)
            assert reward[i].item() == g_rew and terminated[i].item() == g_term and truncated[i].item() == g_trunc
            if g_term or g_trunc:
                ends += 1
                env.reset()
                ours.state[i] = torch.as_tensor(env.unwrapped.state)
                ours.elapsed[i] = 0
            else:
                torch.testing.assert_close(obs[i], g_state, rtol=0, atol=1e-10)
    assert ends > 100  # random play ends an episode every ~20 steps: resets were exercised


def test_truncation_at_500_steps_with_final_obs():
    env = TorchCartPole(2, dtype=torch.float64)
    env.reset(seed=1)
    env.state.zero_()  # upright and still
    env.elapsed[:] = torch.tensor([498, 0])
    alternate = torch.tensor([0, 1])
    _, _, term, trunc, _ = env.step(alternate)
    assert not trunc.any() and not term.any()
    before = env.state.clone()
    obs, reward, term, trunc, info = env.step(alternate.flip(0))
    assert trunc.tolist() == [True, False] and not term.any()
    assert (
        info["final_obs"][0, [0, 2]] - before[0, [0, 2]]
    ).abs().max() < 0.01  # one small step on from where it was cut
    assert (obs[0].abs() <= 0.05).all() and env.elapsed.tolist() == [0, 2]  # env 0 restarted in the same step
    assert info["_final_obs"].tolist() == [True, False] and reward.tolist() == [1.0, 1.0]


def test_termination_thresholds():
    env = TorchCartPole(3, dtype=torch.float64)
    env.reset(seed=0)
    env.state = torch.tensor([[2.39, 1.0, 0.0, 0.0], [0.0, 0.0, 0.2, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    _, _, term, trunc, info = env.step(torch.tensor([1, 1, 1]))
    assert term.tolist() == [True, True, False] and not trunc.any()
    assert info["final_obs"][0, 0] > 2.4


def test_reset_is_seeded_and_in_range():
    a, _ = TorchCartPole(5).reset(seed=3)
    b, _ = TorchCartPole(5).reset(seed=3)
    assert torch.equal(a, b) and a.dtype == torch.float32 and (a.abs() <= 0.05).all()
    # a NumPy int and a 0-d tensor are the same seed (both raised TypeErrors from manual_seed)
    for same in (np.int64(3), torch.tensor(3)):
        assert torch.equal(TorchCartPole(5).reset(seed=same)[0], a)
    two = TorchCartPole(4).reset(seed=[3, 4])[0]
    assert torch.equal(TorchCartPole(4).reset(seed=torch.tensor([3, 4]))[0], two)
    for bad in ("12", 3.0, True):  # "12" was taken as two seeds, "1" and "2"
        with pytest.raises(TypeError, match="seed must be an int"):
            TorchCartPole(4).reset(seed=bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_envs"):
        TorchCartPole(0)
    with pytest.raises(ValueError, match="dtype"):
        TorchCartPole(2, dtype=torch.int32)
    for steps in (0, -3, 2.5, True):  # once accepted: 0 and -3 truncated every step, as Gymnasium refuses to
        with pytest.raises(ValueError, match="max_episode_steps"):
            TorchCartPole(2, max_episode_steps=steps)
    env = TorchCartPole(2)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="shape \\(2,\\)"):
        env.step(torch.tensor([1, 0, 1]))


def test_a_state_set_by_hand_is_checked_and_starts_new_episodes():
    """env.state = ... once took any shape (8 rows into a 1-env CartPole broadcast silently), any dtype (the env
    then ran in float64 for good) and kept the old step counts, so a chosen start state near the time limit was
    truncated after a few steps."""
    env = TorchCartPole(2, max_episode_steps=20)
    env.reset(seed=0)
    for bad, match in (
        (torch.zeros(8, 4), "shape \\(2, 4\\)"),
        (torch.zeros(4), "shape \\(2, 4\\)"),
        (torch.zeros(2, 3), "a state is 4 numbers"),
        (torch.zeros(2, 4, dtype=torch.float64), "torch.float32 on cpu"),
    ):
        with pytest.raises(ValueError, match=match):
            env.state = bad
    with pytest.raises(TypeError, match="torch.as_tensor"):
        env.state = [[0.0] * 4] * 2
    for _ in range(15):
        env.step(torch.tensor([0, 1]))
    env.state = torch.zeros(2, 4)  # upright and still: alternating pushes keep it up for well over 5 steps
    for t in range(10):
        _, _, term, trunc, _ = env.step(torch.tensor([t % 2, (t + 1) % 2]))
        assert not (term | trunc).any(), t


def test_step_before_reset_and_bad_seeds_are_refused():
    with pytest.raises(RuntimeError, match="reset"):  # all-zero states, the same in every env, were stepped
        TorchCartPole(3).step(torch.tensor([0, 1, 0]))
    env = TorchCartPole(2)
    env.state = torch.zeros(2, 4)  # a state set by hand begins the episodes too
    env.step(torch.tensor([0, 1]))
    for bad in ([-1, 2], [1.7, 2.2], ["1", "2"]):  # -1 was the seed 2**64 - 1; 1.7 was 1; "1" was 1
        with pytest.raises(ValueError, match="non-negative int"):
            TorchCartPole(2).reset(seed=bad)
    for big in (2**64, [1, 2**64 + 3]):  # torch.Generator's "Overflow when unpacking long long"
        with pytest.raises(ValueError, match=r"below 2\*\*64 .*seed % 2\*\*64"):
            TorchCartPole(2).reset(seed=big)
    TorchCartPole(2).reset(seed=2**64 - 1)  # the largest a generator takes
    a = TorchCartPole(4).reset(seed=np.array([3, 4]))[0]  # a NumPy array of seeds raised a TypeError
    assert torch.equal(a, TorchCartPole(4).reset(seed=[3, 4])[0])
    with pytest.raises(ValueError, match="block indices"):
        env.keep_blocks([2])
    env.reset(seed=[1, 2])
    with pytest.raises(ValueError, match=r"block index twice \(\[0, 0\]\)"):  # two blocks drew from one generator
        env.keep_blocks([0, 0])


def test_the_default_dtype_and_numpy_counts():
    """Under a float64 default the env ran in float32, and a policy built beside it failed in its first matmul."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert TorchCartPole(2).reset(seed=0)[0].dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert TorchCartPole(np.int64(3)).num_envs == 3
    for flag in ("autoreset", "check_actions"):
        with pytest.raises(TypeError, match=flag):
            TorchCartPole(2, **{flag: "False"})  # a string was truthy: autoreset stayed on


@pytest.mark.parametrize("bad", [[2, 0], [1, -1], [0.5, 1.0]])
def test_an_action_other_than_0_or_1_is_refused_and_the_state_kept(bad):
    """An action of 2 (a policy over 3 actions) or 0.5 (a probability) once pushed left without a word."""
    env = TorchCartPole(2, dtype=torch.float64)
    env.reset(seed=0)
    state, elapsed = env.state.clone(), env.elapsed.clone()
    with pytest.raises(ValueError, match="actions must be 0 \\(push left\\) or 1 \\(push right\\), got \\["):
        env.step(torch.tensor(bad))
    assert torch.equal(env.state, state) and torch.equal(env.elapsed, elapsed)  # nothing stepped
    for fine in ([1, 0], [1.0, 0.0], [True, False]):
        env.step(torch.tensor(fine))
    quiet = TorchCartPole(2, check_actions=False)  # the trainers' setting: no host sync, values not read
    quiet.reset(seed=0)
    quiet.step(torch.tensor([2, 0]))


def _compare_devices(other_device: str, other_seed: int) -> None:
    """Step a float64 CartPole on the CPU and on ``other_device`` from the same states with the same actions.

    The physics must agree. An environment that ends is reset from each env's own generator, and a CUDA
    generator draws other numbers than a CPU one from the same seed, so such an env is compared up to its
    first end only (the old test compared it after the reset too, and failed on the first H200 it met).
    """
    cpu, other = TorchCartPole(64, dtype=torch.float64), TorchCartPole(64, device=other_device, dtype=torch.float64)
    cpu.reset(seed=0)
    other.reset(seed=other_seed)
    other.state = cpu.state.to(other_device)
    gen = torch.Generator().manual_seed(0)
    never_ended = torch.ones(64, dtype=torch.bool)
    for _ in range(20):
        a = torch.randint(0, 2, (64,), generator=gen)
        o1, r1, term1, trunc1, _ = cpu.step(a)
        o2, r2, term2, trunc2, _ = other.step(a.to(other_device))
        assert o2.device.type == torch.device(other_device).type
        torch.testing.assert_close(term2.cpu()[never_ended], term1[never_ended])
        torch.testing.assert_close(r2.cpu()[never_ended], r1[never_ended])
        never_ended &= ~(term1 | trunc1)
        torch.testing.assert_close(o2.cpu()[never_ended], o1[never_ended])
    assert never_ended.any() and not never_ended.all()  # both kinds of env were compared


def test_device_comparison_survives_resets_from_other_random_streams():
    # the CPU stand-in for a GPU: another seed gives the resets other numbers, as a CUDA generator does
    _compare_devices("cpu", other_seed=1)


@pytest.mark.cuda
def test_runs_on_cuda_and_matches_cpu():
    _compare_devices("cuda", other_seed=0)
