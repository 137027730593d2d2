"""DynamicEmbFusedOptimizer: TorchRec's optimizer object whose lr the next backward reads, and
whose state_dict saves that lr (and what LR schedulers add to its param group) so a resumed
schedule goes on where it stopped: alone, inside a CombinedOptimizer, with TorchRec's
``save_param_groups(True)``; a state dict without it is refused."""
import io
import math

import pytest
import torch
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

from dynemb import DynamicEmbFusedOptimizer
from dynemb.rows.fused_optimizer import GROUP_STATE_KEY, PARAM_KEY, checked_lr

BASE_LR, GAMMA, STEP_SIZE = 0.8, 0.5, 2


def test_lr_is_the_first_param_groups_lr_and_schedulers_can_change_it():
    opt = DynamicEmbFusedOptimizer(0.5)
    assert opt.lr == 0.5
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    opt.step()
    scheduler.step()
    assert abs(opt.lr - 0.05) < 1e-12 and opt.param_groups[0]["lr"] == opt.lr


def test_step_and_zero_grad_change_nothing():
    opt = DynamicEmbFusedOptimizer(0.1)
    before = [dict(g) for g in opt.param_groups]
    assert opt.step() is None and opt.zero_grad() is None
    assert [dict(g) for g in opt.param_groups] == before


# -- what state_dict holds ---------------------------------------------------------------------
def _step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=STEP_SIZE, gamma=GAMMA)


def _expected_lr(step):
    """StepLR's closed form: the lr in force after ``step`` scheduler steps."""
    return BASE_LR * GAMMA ** (step // STEP_SIZE)


def _advance(opt, scheduler, steps):
    lrs = []
    for _ in range(steps):
        opt.step()
        scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_state_dict_holds_the_lr_and_what_a_scheduler_added():
    opt = DynamicEmbFusedOptimizer(BASE_LR)
    _advance(opt, _step_lr(opt), 5)
    saved = opt.state_dict()
    assert saved["state"] == {PARAM_KEY: {GROUP_STATE_KEY: {
        "lr": pytest.approx(_expected_lr(5), rel=1e-12), "initial_lr": BASE_LR}}}
    opt.save_param_groups(True)
    (group,) = opt.state_dict()["param_groups"]
    assert group == {"params": [PARAM_KEY], "lr": pytest.approx(_expected_lr(5), rel=1e-12),
                     "initial_lr": BASE_LR}


def _round_trip(state_dict):
    """What torch.save then torch.load gives back."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("save_param_groups", [False, True])
@pytest.mark.parametrize("scheduler_before_load", [True, False])
def test_a_fresh_optimizer_and_scheduler_resume_the_schedule(save_param_groups,
                                                             scheduler_before_load):
    # the uninterrupted run, and torch.optim.SGD driven by the same scheduler as reference
    opt = DynamicEmbFusedOptimizer(BASE_LR)
    opt.save_param_groups(save_param_groups)
    scheduler = _step_lr(opt)
    _advance(opt, scheduler, 3)
    saved_opt, saved_sched = _round_trip(opt.state_dict()), _round_trip(scheduler.state_dict())
    uninterrupted = _advance(opt, scheduler, 4)
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=BASE_LR)
    ref_scheduler = _step_lr(reference)
    _advance(reference, ref_scheduler, 3)
    assert _advance(reference, ref_scheduler, 4) == uninterrupted

    fresh = DynamicEmbFusedOptimizer(BASE_LR)   # the constructor's lr, not the saved one
    fresh.save_param_groups(save_param_groups)
    if scheduler_before_load:
        fresh_scheduler = _step_lr(fresh)
        fresh.load_state_dict(saved_opt)
    else:  # the group has no initial_lr yet when the saved one (which has it) loads
        fresh.load_state_dict(saved_opt)
        fresh_scheduler = _step_lr(fresh)
    fresh_scheduler.load_state_dict(saved_sched)
    assert fresh.lr == _expected_lr(3) != BASE_LR
    assert _advance(fresh, fresh_scheduler, 4) == uninterrupted
    assert uninterrupted == pytest.approx([_expected_lr(s) for s in range(4, 8)], rel=1e-12)


@pytest.mark.parametrize("save_param_groups", [False, True])
def test_a_combined_optimizer_with_a_dense_one_resumes_the_schedule(save_param_groups):
    """LambdaLR over a CombinedOptimizer holding the fused optimizer and a dense SGD."""
    def build():
        weight = torch.nn.Parameter(torch.zeros(2))
        dense = KeyedOptimizerWrapper({"w": weight}, lambda ps: torch.optim.SGD(ps, lr=0.3))
        fused = DynamicEmbFusedOptimizer(BASE_LR)
        combined = CombinedOptimizer([("sparse.ec", fused), ("dense", dense)])
        combined.save_param_groups(save_param_groups)
        return combined, fused, torch.optim.lr_scheduler.LambdaLR(
            combined, lambda step: 1.0 / (1 + step))

    combined, fused, scheduler = build()
    _advance(combined, scheduler, 3)
    saved = combined.state_dict()
    assert saved["state"]["sparse.ec." + PARAM_KEY][GROUP_STATE_KEY]["lr"] == BASE_LR / 4
    saved, saved_sched = _round_trip(saved), _round_trip(scheduler.state_dict())
    uninterrupted = []
    for _ in range(3):
        combined.step()
        scheduler.step()
        uninterrupted.append([g["lr"] for g in combined.param_groups])

    combined, fused, scheduler = build()
    combined.load_state_dict(saved)
    scheduler.load_state_dict(saved_sched)
    assert fused.lr == BASE_LR / 4
    resumed = []
    for _ in range(3):
        combined.step()
        scheduler.step()
        resumed.append([g["lr"] for g in combined.param_groups])
    assert [lrs[0] for lrs in resumed] == [lrs[0] for lrs in uninterrupted]
    assert [lrs[0] for lrs in resumed] == pytest.approx([BASE_LR / s for s in (5, 6, 7)])
    if save_param_groups:  # TorchRec saves the dense lr only then
        assert resumed == uninterrupted


# -- a state dict without the lr -------------------------------------------------------------------
@pytest.mark.parametrize("saved", [{"state": {}}, {"state": {}, "param_groups": [
    {"params": [], "lr": 0.3}]}, {"param_groups": []}, ["not", "a", "dict"]])
def test_a_state_dict_without_the_param_groups_state_is_refused_naming_it(saved):
    opt = DynamicEmbFusedOptimizer(BASE_LR)
    opt.save_param_groups(True)
    opt.param_groups[0]["lr"] = 0.25
    before = opt.state_dict()
    with pytest.raises(ValueError, match=r"no state\['dynamic_tables'\] \(the param group"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.25 and opt.state_dict() == before


@pytest.mark.parametrize("bad", ["0.1", True, math.nan, math.inf, -0.5, None])
def test_a_bad_saved_lr_is_refused_and_the_group_is_unchanged(bad):
    opt = DynamicEmbFusedOptimizer(BASE_LR)
    saved = {"state": {PARAM_KEY: {GROUP_STATE_KEY: {"lr": bad, "initial_lr": 1.0}}}}
    with pytest.raises((TypeError, ValueError), match=r"param_group\['lr'\]"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0] == {"params": opt.param_groups[0]["params"], "lr": BASE_LR}


@pytest.mark.parametrize("bad,error", [("0.1", TypeError), (True, TypeError),
                                       (math.nan, ValueError), (-1.0, ValueError)])
def test_a_bad_lr_is_refused_by_the_lr_property_and_the_constructor(bad, error):
    opt = DynamicEmbFusedOptimizer(0.1)
    opt.param_groups[0]["lr"] = bad
    with pytest.raises(error, match=r"param_groups\[0\]\['lr'\]"):
        opt.lr
    with pytest.raises(error, match="lr"):
        DynamicEmbFusedOptimizer(bad)
    assert checked_lr(torch.tensor(0.5)) == 0.5
