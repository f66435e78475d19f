"""The curation wing: raw SCLARO labels -> shared canonical vocabularies
(`python -m data_prep curate`).

`pipeline` runs a curation (its names are re-exported here, where `data_prep.curate` always had
them); `rules` gathers the text rules of `text`, `objects`, `relations`, `predicates` and
`actions`; `cluster` embeds and clusters object names, `extend` grows an earlier curation,
`report` draws the clusters for the person who labels them and `cli` is the sub-command.
Shared pieces (shards, durable files) live at the top of `data_prep`; this wing imports no
other wing.
"""

from data_prep.curate.pipeline import (ACTION_SIMILARITY, PREDICATE_TABLE, Curator, NeedsLabels,
                                       action_candidate_rows, curate, extend_clusters_file,
                                       format_statistics, iter_samples, predicate_table_text,
                                       read_samples, relation_curation_doc,
                                       save_object_curation, write_replacing)

__all__ = ["ACTION_SIMILARITY", "PREDICATE_TABLE", "Curator", "NeedsLabels",
           "action_candidate_rows", "curate", "extend_clusters_file", "format_statistics",
           "iter_samples", "predicate_table_text", "read_samples", "relation_curation_doc",
           "save_object_curation", "write_replacing"]
