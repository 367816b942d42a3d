"""Worked solution for Chapter 2. Open it with ``edurl.exercises.show_solution("reinforce_loss")``."""


def reinforce_loss(logprobs, returns):
    """Exercise 2.1: -mean(log pi(a_t|s_t) * normalised G_t)."""
    # Normalise the returns over the batch: subtracting the mean is a baseline (Chapter 3),
    # dividing by the std keeps the step size steady as episodes get longer.
    weights = (returns - returns.mean()) / (returns.std() + 1e-8)
    # The returns are data, not something to differentiate through.
    weights = weights.detach()
    # Gradient *descent* on this loss is gradient *ascent* on sum log pi * G: hence the minus sign.
    return -(logprobs * weights).mean()


def reinforce_update(policy, optimizer, envs, seeds, gamma, device):
    """Exercise 2.2: one REINFORCE update. Returns (the episode batch, the loss)."""
    from edurl.rl import collect_episodes, discounted_returns

    # 1. One fresh episode per env with the current policy; env i is reset with seeds[i].
    batch = collect_episodes(envs, policy.act, device, seeds=seeds)
    # 2. Reward-to-go for every step; padding sits after each episode's done, so its return is 0.
    returns = discounted_returns(batch.rewards, batch.dones, gamma)
    # Keep only the real steps: padded steps are not actions anyone took.
    obs = batch.obs[batch.mask]
    actions = batch.actions[batch.mask]
    G = returns[batch.mask]
    # 3. The surrogate loss of exercise 2.1 on the log-probs of the actions taken.
    logprobs = policy(obs).log_prob(actions)
    loss = reinforce_loss(logprobs, G)
    # 4. One step. zero_grad first: backward() adds to whatever gradient is already there.
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return batch, loss
