"""Checkpoint checks shared by the integration tests (tests/test_integration_variants.py,
tests/test_tensor_parallel_module.py)."""

import torch


def assert_both_load_back(new, original, saved):
    """With this rank's experts zeroed, the full checkpoint ``original`` and the rank's own
    ``saved`` shard each load back (strict) to what the rank saved."""
    with torch.no_grad():
        for p in new.experts.parameters():
            p.zero_()
    for state in (original, saved):
        new.load_state_dict(state)
        assert all(torch.equal(new.state_dict()[k], v) for k, v in saved.items())
