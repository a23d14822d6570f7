"""The training data: preparing the seeds' datasets as VeRL-schema parquet (prep: `rlfabric prepare-data`, the
quickstart's and the examples' files), generating reasoning-gym's rows (reasoning_gym), and reading them into
prompt rows with a resumable cursor (dataset: RLHFDataset, DataCursor). The coordinator reads them; nothing here
knows about a run."""
