"""The model as pure functions over a plain params tree: transformer, attention, MoE, routing, params.

    tokens_BL
      -> embedding                       transformer.py   hidden_states (token_ids, the embedding rows)
      -> blocks, each:                   transformer.py   block (its regions through the runner, seams.py)
           attention (GQA, MLA, RoPE)    attention.py
           MoE (or a dense MLP):         moe.py           moe_block
             route                       routing.py       route, the built-in routers (a Router of your own)
             -> permute                  moe.py           sorted_rows / permute
             -> experts                  moe.py           expert_mlp (grouped GEMM: fnmoe.kernels.gemm)
             -> unpermute                moe.py           combined / unpermute; shared experts added
           in token chunks               moe_chunks.py    chunked (model.moe.token_chunks)
           in sequence chunks            block_chunks.py  run (memory.block_chunks)
      -> final norm -> head              transformer.py   hidden_states' final norm; forward -> logits_BLV, aux

params.py holds the parameter schema and its init in one process (leaf_inits, init_params; a mesh's
shards: fnmoe.parallel.sharding.init_params); seams.py what the model runs through, chosen by its
caller (BlockRunner, ParamsSource, mark; the expert-parallel Exchange a MoE layer's params carry as
"ep"); transforms.py the model's paths under torch.func's transforms. The model imports nothing from
fnmoe.parallel, fnmoe.memory or fnmoe.training (tests/test_house.py).
"""
