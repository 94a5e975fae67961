"""Studies (docs/design.md §7): the Fisher of a prompt set over sampled responses, Fisher masks, and the
paper's statistics, from a prompt file to a mask file and a summary.

``prompts`` reads and encodes the prompt file, ``rewards`` scores decoded responses against targets,
``spec`` says what a study is, ``cost`` estimates it before it runs, ``runner`` computes one part (any
subset of the prompts) and adds parts up, ``masks`` and ``statistics`` turn the summed arrays into
masks, shares and comparisons, ``summary`` assembles the JSON and ``files`` writes everything
atomically. The math itself is ``workers.fisher.study``.
"""
