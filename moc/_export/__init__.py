"""``moc export`` and ``CheckpointStore.export``: the tensors of a checkpoint as the model
holds them, planned from the manifest and streamed (:mod:`.plan`), and the writers for
safetensors, DCP and ``torch.save`` files (:mod:`.formats`, imported on demand: the store
exports through :mod:`.plan`, and the writers use the store)."""

from .plan import export_state, pick_manifest, plan_export

__all__ = ["export_state", "pick_manifest", "plan_export"]
