"""memlm.studies: read many finished runs into report tables and plots.

    python -m memlm.studies.ablation_report runs/ablation runs/ablation_sweep \
        --replicates runs/seed1 --levers runs/levers --out docs/results.md

Analysis, not launching: `memlm.launch` turns configs into processes, this
package reads what those processes left behind (saved configs, summaries,
eval JSON) and writes the generated tables of docs/results.md.
`replicates` pools runs of one config across seeds, `levers` pairs runs that
change one setting with the study's runs at the same seeds, and
`ablation_report` writes the tables and docs/scaling.png; `capacity_report` and
`continual_report` write the knowledge-capacity and learning-vs-forgetting
sections (the latter's runs come from memlm.launch.continual_study; `continual_plan`
reads the plan both share, configs/studies/continual.yaml).
"""
