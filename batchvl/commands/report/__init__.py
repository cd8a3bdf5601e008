"""`batchvl report`: a self-contained HTML page about a job's outputs, and the gallery notebooks show."""
