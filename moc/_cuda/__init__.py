"""moc's door to CUDA: every runtime call moc makes (page-locking, devices, streams,
events, RNG: :mod:`.calls`, where tests install a stand-in with :func:`use_runtime`) and the
device-to-host copies a snapshot is made of (:mod:`.copies`)."""

from .calls import runtime, use_runtime
from .copies import (CudaCopier, CudaCopyBatch, HostCopier, HostRegistration, LateCopies, copier_for, copy_into,
                     finish_copies, host_register)

__all__ = ["runtime", "use_runtime", "CudaCopier", "CudaCopyBatch", "HostCopier", "HostRegistration", "LateCopies",
           "copier_for", "copy_into", "finish_copies", "host_register"]
