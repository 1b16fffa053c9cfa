"""Pure rendering of the sbatch script from Jinja templates."""
