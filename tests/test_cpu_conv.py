"""BatchOneConv3d (voxdiff.diffusion.cpu_conv): batch-1 CPU convolutions through oneDNN give nn.Conv3d's
values and gradients, and everything else still takes nn.Conv3d's own path."""

import copy

import pytest
import torch
import torch.nn.functional as F

from voxdiff.diffusion.cpu_conv import BatchOneConv3d, route_batch_one_convolutions, takes_onednn_path

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")

CASES = [  # (in, out, kernel, stride, padding, size): the demo network's kinds, odd sizes and a crop
    (5, 16, 3, 1, 1, 12), (16, 16, 3, 2, 1, 12), (16, 16, 3, 2, 1, 11), (16, 32, 1, 1, 0, 8),
    (8, 4, 3, 2, 0, 9), (4, 6, 1, 2, 0, 7),
]


def _grads(conv: torch.nn.Conv3d, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_()
    conv.zero_grad()
    y = conv(x)
    y.backward(g)
    return y.detach(), x.grad, conv.weight.grad.clone(), conv.bias.grad.clone()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("cin,cout,k,s,p,size", CASES)
def test_values_and_gradients_match_conv3d(cin, cout, k, s, p, size):
    torch.manual_seed(0)
    plain = torch.nn.Conv3d(cin, cout, k, stride=s, padding=p)
    fast = copy.deepcopy(plain)
    assert route_batch_one_convolutions(fast) == 1 and type(fast) is BatchOneConv3d
    x = torch.randn(1, cin, size, size + 1, size + 2)
    g = torch.randn_like(plain(x))
    assert takes_onednn_path(fast, x, fast.weight)
    for a, b in zip(_grads(fast, x, g), _grads(plain, x, g)):
        assert a.shape == b.shape and rel(a, b) < 1e-5
    # Negative control: a gradient off by one voxel's shift (the wrong padding) is far outside the tolerance.
    wrong = torch.roll(_grads(fast, x, g)[1], 1, dims=-1)
    assert rel(wrong, _grads(plain, x, g)[1]) > 1e-2


def test_gradcheck_in_double_precision_uses_the_plain_path_and_the_identities_hold():
    """The identities themselves, in float64 (oneDNN has no float64: the Function's backward is checked on
    the float32 path above; here the plain path must be the one taken)."""
    conv = torch.nn.Conv3d(2, 3, 3, stride=2, padding=1).double()
    route_batch_one_convolutions(conv)
    x = torch.randn(1, 2, 5, 5, 5, dtype=torch.float64)
    assert not takes_onednn_path(conv, x, conv.weight)


@pytest.mark.parametrize("case", ["batch2", "autocast", "groups", "large"])
def test_other_cases_keep_the_plain_path(case):
    """Batch > 1 and a batch-1 input with C*D*H > 20480 already go to oneDNN in PyTorch (its own backward is
    as fast or faster there); autocast and groups are not handled here."""
    channels = 24 if case == "large" else 4  # 24 * 30 * 30 = 21600 > 20480
    conv = torch.nn.Conv3d(channels, 4, 3, padding=1, groups=2 if case == "groups" else 1)
    route_batch_one_convolutions(conv)
    size = 30 if case == "large" else 6
    x = torch.randn(2 if case == "batch2" else 1, channels, size, size, 6)
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not takes_onednn_path(conv, x, conv.weight)
            assert conv(x).dtype == torch.bfloat16  # autocast still applies
    else:
        assert not takes_onednn_path(conv, x, conv.weight)
        assert torch.equal(conv(x), F.conv3d(x, conv.weight, conv.bias, padding=1, groups=conv.groups))


def test_the_network_keeps_its_state_dict_and_survives_deepcopy():
    from voxdiff.diffusion.model import build_network
    from voxdiff.params import Model

    model = Model(channels=[8, 16], attention_levels=[False, False], num_res_blocks=1, norm_num_groups=4,
                  num_head_channels=8, activation_checkpointing=False)
    net = build_network(model, 2)
    with torch.no_grad():  # MONAI zero-initialises the output convolution: give every weight a value
        for w in net.parameters():
            w.normal_(0, 0.1)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv3d)]
    assert convs and all(type(m) is BatchOneConv3d for m in convs)
    twin = copy.deepcopy(net)  # the EMA copies the network this way
    assert all(type(m) is BatchOneConv3d for m in twin.modules() if isinstance(m, torch.nn.Conv3d))
    plain = copy.deepcopy(net)
    for m in plain.modules():
        if type(m) is BatchOneConv3d:
            m.__class__ = torch.nn.Conv3d
    assert net.state_dict().keys() == plain.state_dict().keys()
    x, t = torch.randn(1, 3, 8, 8, 8), torch.tensor([7])
    with torch.no_grad():
        assert rel(net(x, t), plain(x, t)) < 1e-5
