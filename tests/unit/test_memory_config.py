"""Memory config presets and compose-time validation."""

from __future__ import annotations

import pytest

from memlm.config.run import compose
from memlm.errors import ConfigError

SMALL = ["memory=memplus", "memory.n_keys=16", "memory.spread=0", "memory.layers=[1]",
         "memory.knn=4", "memory.eval_knn=4"]


def test_presets_compose():
    memplus = compose(["model=373m", "memory=memplus"]).memory
    assert (memplus.kind, memplus.n_keys, memplus.heads, memplus.knn, memplus.k_dim) == ("memplus", 1024, 4, 32, 512)
    assert memplus.share_values and memplus.gate == "swilu" and memplus.value_lr == 1e-3
    assert memplus.resolved_layers(24) == [4, 12, 20]
    pk = compose(["model=373m", "memory=pk"]).memory
    assert pk.kind == "memory" and not pk.share_values
    assert compose(["memory=none"]).memory.resolved_layers(2) == []
    assert compose(SMALL).memory.resolved_layers(2) == [1]


@pytest.mark.parametrize(
    "override,key",
    [
        ("memory.k_dim=15", "memory.k_dim"),
        ("memory.k_dim=0", "memory.k_dim"),
        ("memory.knn=17", "memory.knn"),
        ("memory.knn=0", "memory.knn"),
        ("memory.eval_knn=0", "memory.eval_knn"),
        ("memory.eval_knn=32", "memory.eval_knn"),
        ("memory.heads=0", "memory.heads"),
        ("memory.n_keys=0", "memory.n_keys"),
        ("memory.v_dim=-1", "memory.v_dim"),
        ("memory.gate=relu", "memory.gate"),
        ("memory.placement=before", "memory.placement"),
        ("memory.kernel=cuda", "memory.kernel"),
        ("memory.value_lr=0", "memory.value_lr"),
        ("memory.value_weight_decay=-0.1", "memory.value_weight_decay"),
        ("memory.value_grad_clip=-1", "memory.value_grad_clip"),
        ("memory.value_init_scale=-0.5", "memory.value_init_scale"),
        ("memory.balance_loss_coef=-0.01", "memory.balance_loss_coef"),
        ("memory.knn_schedule_start=17", "memory.knn_schedule_start"),
        ("memory.knn_schedule_start=2", "memory.knn_schedule_steps"),  # start without steps
        ("memory.layers=[5]", "memory.layers"),
        ("parallel.memory_parallel=3", "memory.v_dim"),  # 64 columns over 3 ranks
    ],
)
def test_bad_values_fail_at_compose_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        compose([*SMALL, override])
    assert err.value.key == key
    assert key in str(err.value)


def test_w1_w2_biases_are_a_memplus_switch_off_by_default():
    """memory.w_bias: off in every preset (no run has measured it yet), on only for Memory+."""
    assert compose(["model=373m", "memory=memplus"]).memory.w_bias is False
    assert compose(["memory=pk", "memory.layers=[0]", "memory.spread=0"]).memory.w_bias is False
    assert compose([*SMALL, "memory.w_bias=true"]).memory.w_bias is True
    for preset in (["memory=pk", "memory.layers=[0]", "memory.spread=0"], ["memory=none"]):
        with pytest.raises(ConfigError) as err:
            compose([*preset, "memory.w_bias=true"])
        assert err.value.key == "memory.w_bias" and err.value.value is True
        assert "memory.kind=memplus" in str(err.value)


def test_bad_values_also_fail_for_plain_memory():
    with pytest.raises(ConfigError, match="memory.k_dim"):
        compose(["memory=pk", "memory.layers=[0]", "memory.spread=0", "memory.k_dim=7"])
