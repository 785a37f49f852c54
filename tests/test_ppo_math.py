"""PPO arithmetic (storyrl.training.storyteller.rl.ppo.math) against hand computations.

Every reference below is written out by hand or with plain Python loops over
lists, never by calling the function under test; the examples include
masked (padding) positions, which must not count.
"""

from __future__ import annotations

import math

import pytest

import storyrl  # noqa: F401

torch = pytest.importorskip("torch")

from storyrl.training.storyteller.rl.ppo import math as pm  # noqa: E402

T = torch.tensor


def flat(rows):
    return [x for row in rows for x in row]


def test_masked_mean_var_whiten_by_hand():
    values = T([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = T([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    # masked entries: 1 2 3 4 -> mean 2.5, squared deviations 2.25 .25 .25 2.25 = 5, unbiased var 5/3
    assert pm.masked_mean(values, mask).item() == pytest.approx(2.5)
    assert pm.masked_var(values, mask).item() == pytest.approx(5 / 3)
    assert pm.masked_var(values, mask, unbiased=False).item() == pytest.approx(1.25)
    # per-row means over dim 1: (1+2)/2, (3+4)/2
    assert pm.masked_mean(values, mask, dim=1).tolist() == pytest.approx([1.5, 3.5])
    white = pm.masked_whiten(values, mask)
    sd = math.sqrt(5 / 3 + 1e-8)
    assert white[0, :2].tolist() == pytest.approx([(1 - 2.5) / sd, (2 - 2.5) / sd])
    assert white[1, :2].tolist() == pytest.approx([(3 - 2.5) / sd, (4 - 2.5) / sd])
    kept = pm.masked_whiten(values, mask, shift_mean=False)  # TRL's reward whitening: scale only
    assert kept[0, :2].tolist() == pytest.approx([(1 - 2.5) / sd + 2.5, (2 - 2.5) / sd + 2.5])
    # an empty mask: mean 0 (a zero loss), too few values for a variance
    empty = torch.zeros_like(mask)
    assert pm.masked_mean(values, empty).item() == 0.0
    with pytest.raises(ValueError, match="too few"):
        pm.masked_var(values, empty)


def test_kl_estimators_by_hand():
    logp = T([[-1.0, -2.0], [-0.5, -3.0]])
    ref = T([[-1.5, -1.0], [-0.5, -2.0]])
    k1 = [[-1.0 + 1.5, -2.0 + 1.0], [0.0, -3.0 + 2.0]]
    assert pm.kl_per_token(logp, ref, "k1").flatten().tolist() == pytest.approx(flat(k1))
    k3 = []
    for lp_row, ref_row in zip(logp.tolist(), ref.tolist()):
        row = []
        for lp, rf in zip(lp_row, ref_row):
            r = math.exp(rf - lp)
            row.append((r - 1) - math.log(r))
        k3.append(row)
    assert pm.kl_per_token(logp, ref, "k3").flatten().tolist() == pytest.approx(flat(k3))
    assert min(min(r) for r in k3) >= 0  # k3 never negative
    with pytest.raises(ValueError, match="k1 or k3"):
        pm.kl_per_token(logp, ref, "k2")


def test_token_rewards_put_the_score_at_the_last_real_token():
    kl = T([[0.1, 0.2, 0.3, 0.4], [0.5, -0.1, 9.0, 9.0], [1.0, 1.0, 1.0, 1.0]])
    mask = T([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    scores = T([2.0, -1.0, 5.0])
    rewards, non_score = pm.token_rewards(kl, scores, mask, kl_coef=0.5)
    assert non_score.flatten().tolist() == pytest.approx(flat([[-0.05, -0.1, -0.15, -0.2], [-0.25, 0.05, 0, 0],
                                                               [0, 0, 0, 0]]))
    # row 0 ends at index 3, row 1 at index 1; row 2 has no token and gets no score
    assert rewards.flatten().tolist() == pytest.approx(flat([[-0.05, -0.1, -0.15, -0.2 + 2.0],
                                                             [-0.25, 0.05 - 1.0, 0, 0], [0, 0, 0, 0]]))


def _gae_by_hand(rewards, values, length, gamma, lam):
    """GAE over the first ``length`` entries of one row, as in the paper."""
    adv = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
    returns = [a + v if t < length else 0.0 for t, (a, v) in enumerate(zip(adv, values))]
    return adv, returns


def test_gae_by_hand_with_padding():
    rewards = [[0.0, -0.1, 1.0, 7.0], [0.5, 0.2, -0.3, 0.4]]
    values = [[0.2, 0.4, 0.6, 5.0], [1.0, 0.0, -1.0, 2.0]]
    lengths = [3, 4]  # row 0: the last entry is padding (its 7.0 and 5.0 must not count)
    mask = T([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    gamma, lam = 0.9, 0.8
    adv, ret = pm.gae(T(rewards), T(values), mask, gamma, lam)
    for row in range(2):
        a, r = _gae_by_hand(rewards[row], values[row], lengths[row], gamma, lam)
        assert adv[row].tolist() == pytest.approx(a)
        assert ret[row].tolist() == pytest.approx(r)
    # one step worked out fully: row 0, t=2 (last real token): δ = 1.0 + 0.9·0 − 0.6 = 0.4
    assert adv[0, 2].item() == pytest.approx(0.4)
    # t=1: δ = −0.1 + 0.9·0.6 − 0.4 = 0.04; A = 0.04 + 0.72·0.4 = 0.328
    assert adv[0, 1].item() == pytest.approx(0.328)


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    rewards = T([[0.1, 0.2, 0.3]])
    values = T([[1.0, 2.0, 3.0]])
    adv, ret = pm.gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), 1.0, 1.0)
    assert adv.tolist()[0] == pytest.approx([0.6 - 1.0, 0.5 - 2.0, 0.3 - 3.0])
    assert ret.tolist()[0] == pytest.approx([0.6, 0.5, 0.3])


def test_policy_loss_by_hand():
    old = [[-1.0, -1.0, -2.0], [-0.5, -0.7, -9.0]]
    new = [[-0.5, -1.5, -2.0], [-0.5, -0.2, 4.0]]
    adv = [[1.0, -2.0, 0.5], [3.0, -1.0, 100.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    eps = 0.2
    terms, clipped_count, sq = [], 0, []
    for i in range(2):
        for j in range(3):
            if not mask[i][j]:
                continue
            ratio = math.exp(new[i][j] - old[i][j])
            a = -adv[i][j] * ratio
            b = -adv[i][j] * min(max(ratio, 1 - eps), 1 + eps)
            terms.append(max(a, b))
            clipped_count += b > a
            sq.append((new[i][j] - old[i][j]) ** 2)
    loss, clipfrac, approx_kl = pm.policy_loss(T(new), T(old), T(adv), T(mask, dtype=torch.bool), eps)
    assert loss.item() == pytest.approx(sum(terms) / len(terms))
    assert clipfrac.item() == pytest.approx(clipped_count / len(terms))
    assert clipped_count == 2  # ratio e^0.5 with A=1 and e^0.5 with A=−1 are clipped (not the others)
    assert approx_kl.item() == pytest.approx(0.5 * sum(sq) / len(sq))


def test_policy_loss_gradient_is_zero_where_clipped():
    new = T([[0.5, 0.0]], requires_grad=True)  # ratio e^0.5 > 1.2 with A > 0: clipped, no gradient
    loss, _, _ = pm.policy_loss(new, T([[0.0, 0.0]]), T([[1.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool), 0.2)
    loss.backward()
    # second token: ratio 1, d(−A·ρ)/dlogp = −A·ρ = −1, averaged over 2 tokens
    assert new.grad.flatten().tolist() == pytest.approx([0.0, -0.5])


def test_value_loss_by_hand():
    vpred = [[1.0, 0.0, 2.0], [0.5, 0.5, 3.0]]
    old = [[0.5, 0.1, 0.0], [0.5, 1.0, 0.0]]
    ret = [[2.0, -1.0, 0.0], [0.0, 0.0, 0.0]]
    mask = [[1, 1, 0], [1, 1, 1]]
    eps = 0.2
    terms, clipped_count = [], 0
    for i in range(2):
        for j in range(3):
            if not mask[i][j]:
                continue
            clipped_v = min(max(vpred[i][j], old[i][j] - eps), old[i][j] + eps)
            a = (vpred[i][j] - ret[i][j]) ** 2
            b = (clipped_v - ret[i][j]) ** 2
            terms.append(max(a, b))
            clipped_count += b > a
    loss, clipfrac = pm.value_loss(T(vpred), T(old), T(ret), T(mask, dtype=torch.bool), eps)
    assert loss.item() == pytest.approx(0.5 * sum(terms) / len(terms))
    assert clipfrac.item() == pytest.approx(clipped_count / len(terms))
    # (0,0): V=1 clipped to 0.7, target 2: clipped error larger; (1,2): V=3 → 0.2, target 0: unclipped larger
    assert 0 < clipped_count < len(terms)


def test_adaptive_kl_controller_by_hand():
    ctl = pm.AdaptiveKLController(0.1, target=6.0, horizon=100)
    ctl.update(9.0, n_steps=10)  # error clip(9/6 − 1) = 0.2 → × (1 + 0.2·10/100) = 1.02
    assert ctl.value == pytest.approx(0.102)
    ctl.update(5.4, n_steps=10)  # error 5.4/6 − 1 = −0.1 → × 0.99
    assert ctl.value == pytest.approx(0.102 * 0.99)
    ctl.update(0.0, n_steps=50)  # error −1 clipped to −0.2 → × 0.9
    assert ctl.value == pytest.approx(0.102 * 0.99 * 0.9)
    fixed = pm.FixedKLController(0.05)
    fixed.update(100.0, 8)
    assert fixed.value == 0.05


def test_running_moments_equal_the_statistics_of_everything_seen():
    batches = [[1.0, 2.0, 4.0], [10.0, -3.0], [0.5]]
    moments = pm.RunningMoments()
    seen = []
    for batch in batches:
        mean, std = moments.update(T(batch))
        assert mean == pytest.approx(sum(batch) / len(batch))
        seen += batch
        n = len(seen)
        m = sum(seen) / n
        var = sum((x - m) ** 2 for x in seen) / n
        assert moments.mean == pytest.approx(m)
        assert moments.var == pytest.approx(var)
        assert moments.std == pytest.approx(math.sqrt(var * n / (n - 1)))
    assert moments.count == pytest.approx(6)
    restored = pm.RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert restored == moments


def test_scale_scores_by_hand():
    scores = T([2.0, -4.0, 1.0])
    assert pm.scale_scores(scores, std=2.0, eps=0.0).tolist() == pytest.approx([1.0, -2.0, 0.5])
    assert pm.scale_scores(scores, mean=1.0, std=2.0, eps=0.0).tolist() == pytest.approx([0.5, -2.5, 0.0])
    assert pm.scale_scores(scores, mean=1.0, std=2.0, clip=1.0, eps=0.0).tolist() == pytest.approx([0.5, -1.0, 0.0])
    assert pm.scale_scores(scores, clip=1.5).tolist() == pytest.approx([1.5, -1.5, 1.0])
