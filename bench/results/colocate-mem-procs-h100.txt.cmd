572 python3 bench/bench_colocate.py --out /root/out/colocate-mem.jsonl 
1439 /opt/torch/.venv/bin/python3 -u -m rlslurm.trainer.main --run-dir /tmp/rlslurm-colocate-bench/run-1795747326 
2127 sglang::scheduler                                                                                                                                 
