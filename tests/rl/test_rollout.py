import gymnasium as gym
import numpy as np
import pytest
import torch

from edurl.rl import CategoricalPolicy, collect_episodes, collect_rollout, evaluate_policy, make_vector_env

CPU = torch.device("cpu")


def _policy(seed=0):
    torch.manual_seed(seed)
    return CategoricalPolicy(4, 2)


def test_rollout_keeps_final_observations_and_never_uses_reset_obs_as_next():
    envs = make_vector_env("CartPole-v1", 3, max_episode_steps=7)  # forces truncations every 7 steps
    obs, _ = envs.reset(seed=0)
    ro, obs_after, _ = collect_rollout(envs, _policy(), obs, 40, CPU)
    done = ro.terminated | ro.truncated
    assert ro.truncated.any() and ro.obs.shape == (40, 3, 4) and ro.next_obs.shape == (40, 3, 4)
    # Inside an episode, s_{t+1} is the next row's s_t.
    same = ~done[:-1]
    assert torch.equal(ro.next_obs[:-1][same], ro.obs[1:][same])
    # At an episode end, the next row starts a new episode from a reset observation (all |x| <= 0.05),
    # while next_obs holds the final observation of the old one, a different state.
    ends = done[:-1]
    assert (ro.obs[1:][ends].abs() <= 0.05).all()
    assert not torch.isclose(ro.next_obs[:-1][ends], ro.obs[1:][ends]).all(-1).any()
    # The last row continues from the returned observation.
    last_live = ~done[-1]
    assert torch.equal(ro.next_obs[-1][last_live], torch.as_tensor(obs_after, dtype=torch.float32)[last_live])


def test_truncated_final_obs_is_where_the_episode_really_was():
    # Replaying the same seed and actions in a plain env reaches the same state at the truncation step.
    envs = make_vector_env("CartPole-v1", 1, max_episode_steps=5)
    obs, _ = envs.reset(seed=3)
    ro, _, _ = collect_rollout(envs, _policy(1), obs, 5, CPU)
    assert ro.truncated[4, 0] and not ro.terminated[:, 0].any()
    env = gym.make("CartPole-v1", max_episode_steps=5)
    env.reset(seed=3)
    for a in ro.actions[:, 0].tolist():
        final, *_ = env.step(a)
    np.testing.assert_allclose(ro.next_obs[4, 0].numpy(), final, rtol=1e-6)


def test_episode_counter_reports_finished_episodes():
    envs = make_vector_env("CartPole-v1", 2, max_episode_steps=10)
    obs, _ = envs.reset(seed=0)
    ro, obs, counter = collect_rollout(envs, _policy(), obs, 25, CPU)
    done = ro.terminated | ro.truncated
    assert len(ro.episode_returns) == int(done.sum())
    assert all(ret == length for ret, length in zip(ro.episode_returns, ro.episode_lengths))  # +1 per step
    assert all(length <= 10 for length in ro.episode_lengths)


def test_rollout_rejects_next_step_autoreset():
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    obs, _ = envs.reset(seed=0)
    with pytest.raises(ValueError, match="SAME_STEP autoreset"):
        collect_rollout(envs, _policy(), obs, 4, CPU)


def test_rollout_refuses_a_torch_env_without_autoreset_and_empty_rollouts():
    """A TorchCartPole(autoreset=False) was taken: its finished envs kept stepping, and every later step was
    counted as a one-step episode."""
    from edurl.envs import TorchCartPole

    env = TorchCartPole(2, autoreset=False, max_episode_steps=20)
    obs, _ = env.reset(seed=0)
    with pytest.raises(ValueError, match="autoreset=True"):
        collect_rollout(env, _policy(), obs, 60, CPU)
    with pytest.raises(ValueError, match="num_steps"):  # a raw 'stack expects a non-empty TensorList'
        collect_rollout(TorchCartPole(2), _policy(), TorchCartPole(2).reset(seed=0)[0], 0, CPU)


def test_collect_episodes_checks_its_actions_and_seeds():
    envs = [gym.make("CartPole-v1") for _ in range(3)]
    policy = _policy()

    def probs(obs):  # probabilities instead of actions: int(0.7) was 0, so every action pushed left
        return policy(obs).probs[:, 1].detach()

    with pytest.raises(ValueError, match="whole actions"):
        collect_episodes(envs, probs, CPU, seeds=[0, 1, 2])
    with pytest.raises(ValueError, match="outside 0..1"):
        collect_episodes(envs, lambda obs: policy.act(obs) + 1, CPU, seeds=[0, 1, 2])
    with pytest.raises(ValueError, match="one action per running env"):
        collect_episodes(envs, lambda obs: policy.act(obs)[:1], CPU, seeds=[0, 1, 2])
    for seeds in ([0], [0, 1, 2, 3]):  # an IndexError, or the extra seeds silently ignored
        with pytest.raises(ValueError, match="one seed per env"):
            collect_episodes(envs, policy.act, CPU, seeds=seeds)
    float_actions = collect_episodes(envs, lambda obs: policy.act(obs).float(), CPU, seeds=[0, 1, 2])
    collect_episodes(envs, lambda obs: obs[:, 2] > 0, CPU, seeds=[0, 1, 2])  # bools: True pushes right, as int(True)
    assert float_actions.rewards.shape[1] == 3  # whole numbers as floats are still actions


def test_evaluate_policy_closes_its_envs(monkeypatch):
    closed = []
    original = gym.Env.close

    def close(self):
        closed.append(self)
        return original(self)

    monkeypatch.setattr(gym.Wrapper, "close", close)
    evaluate_policy(_policy(), "CartPole-v1", 20, CPU)
    assert len(closed) >= 20  # each of the 20 episodes' envs (its wrappers may close in turn)
    with pytest.raises(ValueError, match="num_episodes"):  # -5 gave an empty array
        evaluate_policy(_policy(), "CartPole-v1", -5, CPU)


def test_space_sizes_refuses_actions_that_do_not_start_at_0():
    from edurl.rl.rollout import space_sizes

    with pytest.raises(ValueError, match="start at -1"):
        space_sizes(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(3, start=-1), "MyEnv")
    assert space_sizes(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(3), "MyEnv") == (4, 3)


def test_collect_episodes_pads_and_masks():
    envs = [gym.make("CartPole-v1") for _ in range(4)]
    policy = _policy()
    batch = collect_episodes(envs, policy.act, CPU, seeds=[0, 1, 2, 3])
    T = batch.rewards.shape[0]
    assert T == int(batch.lengths.max())
    torch.testing.assert_close(batch.episode_returns, batch.lengths.float())  # CartPole: reward 1 per real step
    assert torch.equal(batch.dones.sum(0), torch.ones(4, dtype=torch.long))  # exactly one end per episode
    last = batch.lengths - 1
    assert batch.dones[last, torch.arange(4)].all() and batch.mask[last, torch.arange(4)].all()
    assert not batch.mask[batch.lengths.clamp(max=T - 1)[batch.lengths < T], torch.arange(4)[batch.lengths < T]].any()
    assert batch.terminated.all()  # a random-ish policy never lasts 500 steps
    # Same seeds, same policy weights and torch seed: same episodes.
    torch.manual_seed(5)
    a = collect_episodes(envs, policy.act, CPU, seeds=[0, 1, 2, 3])
    torch.manual_seed(5)
    b = collect_episodes(envs, policy.act, CPU, seeds=[0, 1, 2, 3])
    assert torch.equal(a.actions, b.actions)


def test_evaluate_policy_counts_episodes():
    returns = evaluate_policy(_policy(), "CartPole-v1", 20, CPU)
    assert returns.shape == (20,) and (returns >= 8).all()


def test_rollout_on_torch_cartpole_keeps_final_obs_and_counts_episodes():
    from edurl.envs import TorchCartPole

    env = TorchCartPole(4, max_episode_steps=6)
    obs, _ = env.reset(seed=0)
    ro, obs_after, _ = collect_rollout(env, _policy(), obs, 20, CPU)
    done = ro.terminated | ro.truncated
    assert ro.truncated.any() and isinstance(obs_after, torch.Tensor)
    same = ~done[:-1]
    assert torch.equal(ro.next_obs[:-1][same], ro.obs[1:][same])
    ends = done[:-1]
    assert not torch.isclose(ro.next_obs[:-1][ends], ro.obs[1:][ends]).all(-1).any()
    assert len(ro.episode_returns) == int(done.sum()) and all(r <= 6 for r in ro.episode_lengths)
    assert ro.episode_returns == [float(n) for n in ro.episode_lengths]


def test_policy_sample_logprobs_match_the_distribution():
    policy = _policy()
    obs = torch.randn(50, 4)
    actions, logprobs = policy.sample(obs)
    torch.testing.assert_close(logprobs, policy(obs).log_prob(actions))
    lp, ent = policy.logprob_and_entropy(obs, actions)
    torch.testing.assert_close(lp, logprobs)
    torch.testing.assert_close(ent, policy(obs).entropy())


@pytest.mark.parametrize("trainer", ["reinforce", "a2c", "ppo"])
def test_trainers_refuse_an_env_their_policy_cannot_act_in(trainer):
    # Pendulum's actions are continuous: the trainers used to fail deep inside with
    # "AttributeError: 'Box' object has no attribute 'n'"
    from edurl.rl import A2CConfig, PPOConfig, ReinforceConfig, train_a2c, train_ppo, train_reinforce

    train, config = {
        "reinforce": (train_reinforce, ReinforceConfig),
        "a2c": (train_a2c, A2CConfig),
        "ppo": (train_ppo, PPOConfig),
    }[trainer]
    with pytest.raises(ValueError, match=r"Pendulum-v1 has a Box action space .*needs a discrete one"):
        train(config(env_id="Pendulum-v1", device="cpu", progress=False))


def _count_closes(monkeypatch) -> list:
    """Every env the trainers make from here on (gym.make, gym.make_vec), each as [env, times closed]."""
    made = []

    def counting(make):
        def wrapped(*args, **kwargs):
            env = make(*args, **kwargs)
            entry = [env, 0]
            close = env.close

            def counted_close():
                entry[1] += 1
                return close()

            env.close = counted_close
            made.append(entry)
            return env

        return wrapped

    monkeypatch.setattr(gym, "make", counting(gym.make))
    monkeypatch.setattr(gym, "make_vec", counting(gym.make_vec))
    return made


class _Stop(Exception):
    pass


def _raise(*args, **kwargs):
    raise _Stop


@pytest.mark.parametrize("trainer", ["reinforce", "a2c", "ppo", "ppo, 2 seeds"])
@pytest.mark.parametrize("how", ["a refused space", "an error in training", "the end"])
def test_trainers_close_their_gymnasium_envs(monkeypatch, trainer, how):
    """Whichever way training ends, every env a trainer made is closed once (an env may hold a window, a
    simulator or a subprocess)."""
    from edurl.rl import A2CConfig, PPOConfig, ReinforceConfig, train_a2c, train_ppo, train_reinforce

    made = _count_closes(monkeypatch)
    train, config, hook = {
        "reinforce": (train_reinforce, ReinforceConfig(max_episodes=8, episodes_per_update=4), "loss_fn"),
        "a2c": (train_a2c, A2CConfig(total_steps=64, num_envs=2, num_steps=16), "losses_fn"),
        "ppo": (train_ppo, PPOConfig(total_steps=64, num_envs=2, num_steps=16), "update_fn"),
        "ppo, 2 seeds": (train_ppo, PPOConfig(total_steps=64, num_envs=2, num_steps=16, num_seeds=2), None),
    }[trainer]
    if hook is None and how == "an error in training":  # update_fn takes one seed: break the stack's update
        monkeypatch.setattr("edurl.rl.ppo._stack_update", _raise)
    config = type(config)(**{**vars(config), "device": "cpu", "progress": False})
    if how == "a refused space":
        with pytest.raises(ValueError, match="needs a discrete one"):
            train(type(config)(**{**vars(config), "env_id": "Pendulum-v1"}))
    elif how == "an error in training":
        with pytest.raises(_Stop):
            train(config, **({hook: _raise} if hook else {}))
    else:
        train(config)
    assert made and [n for _, n in made] == [1] * len(made)


def test_space_sizes_explains_observations_that_are_not_a_flat_vector():
    import gymnasium as gym

    from edurl.rl.rollout import space_sizes

    assert space_sizes(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2), "CartPole-v1") == (4, 2)
    with pytest.raises(ValueError, match=r"Pong has observations .*FlattenObservation"):
        space_sizes(gym.spaces.Box(0, 255, (210, 160, 3)), gym.spaces.Discrete(6), "Pong")


class _TenthReward(gym.Wrapper):
    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        return obs, 0.1, terminated, truncated, info


def test_rewards_keep_the_default_dtype_when_it_is_float64():
    """Rewards were rounded to float32 before anything else saw them, so under float64 a reward of 0.1 came out
    as 0.10000000149 and episode returns as 0.30000000447."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        policy = _policy()
        batch = collect_episodes([_TenthReward(gym.make("CartPole-v1"))], policy.act, CPU, seeds=[0])
        assert batch.rewards.dtype == torch.float64 and batch.rewards[0, 0].item() == 0.1
        envs = gym.vector.SyncVectorEnv(
            [lambda: _TenthReward(gym.make("CartPole-v1"))], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
        )
        obs, _ = envs.reset(seed=0)
        ro, _, _ = collect_rollout(envs, policy, obs, 40, CPU)
        assert ro.rewards.dtype == torch.float64 and ro.rewards[0, 0].item() == 0.1
        length = ro.episode_lengths[0]
        assert ro.episode_returns[0] == pytest.approx(0.1 * length, rel=1e-12, abs=0)
    finally:
        torch.set_default_dtype(previous)


def test_collect_episodes_reads_the_action_range_from_a_discrete_space_with_a_start():
    """The range check took 0..n-1 for every Discrete space; one that starts at -1 plays -1, 0 and 1."""

    class Shifted(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (4,))
        action_space = gym.spaces.Discrete(3, start=-1)

        def reset(self, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return np.zeros(4, np.float32), {}

        def step(self, action):
            assert action in (-1, 0, 1)
            self.t += 1
            return np.zeros(4, np.float32), 1.0, self.t >= 3, False, {}

    batch = collect_episodes([Shifted(), Shifted()], lambda obs: torch.full((len(obs),), -1), CPU)
    assert batch.lengths.tolist() == [3, 3]
    with pytest.raises(ValueError, match="outside -1..1"):
        collect_episodes([Shifted()], lambda obs: torch.full((len(obs),), 2), CPU)


def test_collect_episodes_with_no_envs_says_so():
    """An empty list once failed inside NumPy ("need at least one array to stack")."""
    with pytest.raises(ValueError, match=r"number of envs \(len\(envs\)\) must be a whole number of envs >= 1, got 0"):
        collect_episodes([], lambda obs: torch.zeros(len(obs), dtype=torch.long), torch.device("cpu"))
