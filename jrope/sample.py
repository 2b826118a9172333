r"""Text from a trained byte-level run after each --prompt (a clone: sample.py; docs/results.md):

    python -m jrope.sample --workdir=runs/wikitext_cpu/jordan_exact_scaled/seed0 \
        --prompt=" = Valkyria Chronicles = " --num_tokens=200 --temperature=0.8 --top_p=0.95
"""

from jrope.commands import sample as run_main

if __name__ == "__main__":
    run_main()
