"""Everything between a call's token batches and its results: the ``Pipeline`` protocol
(``pipeline.py``) and one pipeline's loop, pacing, healing and delivery (``local.LocalPipeline``).
Replicas of a pipeline (``replicas.pipeline.ReplicaPipeline``) implement the same protocol one
package up; the engine picks between them (``api.lifecycle.open_pipeline``)."""
