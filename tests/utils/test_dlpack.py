"""dlpack_tensor: a torch view of raw memory that keeps its owner alive."""

import gc
import weakref

import torch

from vllm.utils.dlpack import dlpack_tensor


def test_dlpack_tensor_over_foreign_memory_keeps_owner_alive():
    backing = torch.arange(256, dtype=torch.int32).to(torch.uint8)

    class Owner:
        pass

    owner = Owner()
    ref = weakref.ref(owner)
    t = dlpack_tensor(backing.data_ptr() + 16, 64, torch.device("cpu"), owner)
    del owner
    gc.collect()
    assert ref() is not None
    assert t.data_ptr() == backing.data_ptr() + 16 and t.shape == (64,)
    assert torch.equal(t, backing[16:80])
    t.fill_(1)
    assert int(backing[16:80].sum()) == 64
    del t
    gc.collect()
    assert ref() is None
