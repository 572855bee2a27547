"""What a run leaves behind: metrics.jsonl and TensorBoard (metrics), summary.json and curves.png (report), the books
of every trajectory group (books), and a checkpoint's manifest (checkpoint_files)."""
