"""What a run reads, built once by the driver as a ``DataPipeline`` (:mod:`.pipeline`): the
source resolved once (:mod:`.sources`: a built-in task, a JSONL/Parquet file, a Hub dataset
or given rows; :mod:`.readers` reads them), rows to examples (:mod:`.examples`), the
batches and held-out examples (:mod:`.dataset`), rewards (:mod:`.rewards`, the built-in
scorers in :mod:`.scorers`), the built-in tasks (:mod:`.tasks`) and the run's model
(:mod:`.inputs`). ``config.py`` holds the data, validation and reward sections of the
configuration (it imports nothing else from here).

Imports ``algorithms``, ``agent``, ``rollout``, ``models`` and the foundation."""
