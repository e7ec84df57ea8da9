"""The lanes' modules under their paths before `udfs/lanes/`: a job graph pickled before the move
names its functions by these paths (`udfs.stage.operators.InferenceStage`, ...), so each old module
name is the new module itself. Nothing of the project imports this package."""

import importlib
import sys

MOVED = {
    "admission": "udfs.lanes.admission",
    "batch_lane": "udfs.lanes.provider_batch.lane",
    "inflight": "udfs.lanes.inflight",
    "lane": "udfs.lanes.base",
    "operators": "udfs.lanes.keyed",
    "ordering": "udfs.lanes.ordering",
    "record_path": "udfs.lanes.record_path",
    "user_functions": "udfs.lanes.user_functions",
    "vectorized": "udfs.lanes.vectorized",
}

for _old, _new in MOVED.items():
    sys.modules.setdefault(f"{__name__}.{_old}", importlib.import_module(_new))
