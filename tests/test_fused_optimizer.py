"""DynamicEmbFusedOptimizer: TorchRec's optimizer object whose lr the next backward reads."""
import torch

from dynemb import DynamicEmbFusedOptimizer


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
