"""The import wing: public scene-graph datasets (OpenPSG, Visual Genome) into SCLARO records
without any model, beside annotate (images -> VLM -> GroundingDINO -> SAM), curate and rocs.

    python -m data_prep import --source psg --root /data/openpsg --out /data/sclaro-psg

`psg` and `vg` read each dataset's released layout into `graph.Graph`s; `pipeline` turns them
into records (objects, focused regions from the dataset's masks or boxes, the action word and
caption by the rule of `actions`, the dataset's own split) and writes them with
`data_prep.shards.ShardWriter`, as annotate does. Like every wing it imports only itself and the
shared modules at the top of data_prep (the NLTK checks of `data_prep.nltk_data`, the focused
regions of `data_prep.focus`, the readers' helpers of `data_prep.source_items`). Nothing is
imported here, so `python -m data_prep --help` does not load numpy's and scipy's image code:
`from data_prep.scene_graphs.pipeline import import_scene_graphs`.
"""
