# The model `paddle train --config=trainer_config.py` trains: an N-gram word
# model on imikolov (PTB), in PaddlePaddle v2's trainer-config language, after
# the v2 cluster-training docs. `fab split-data` writes the shards it reads;
# dataprovider.py (your PyDataProvider2 reader, not shipped here) turns them into samples.
from paddle.trainer_config_helpers import *  # noqa: F401,F403

dict_size = len(open("data/imikolov/word_dict.json").read().split(","))  # noqa: SIM115
N, emb_size, hidden = 5, 32, 256

define_py_data_sources2(train_list="data/imikolov/train.list", test_list="data/imikolov/test.list",
                        module="dataprovider", obj="process", args={"dict_size": dict_size, "N": N})
settings(batch_size=256, learning_rate=1e-3, learning_method=AdaGradOptimizer())

words = [data_layer(name="w%d" % i, size=dict_size) for i in range(N - 1)]
embs = [embedding_layer(input=w, size=emb_size, param_attr=ParamAttr(name="_emb", sparse_update=True))
        for w in words]
hidden_layer = fc_layer(input=concat_layer(input=embs), size=hidden, act=SigmoidActivation())
predict = fc_layer(input=hidden_layer, size=dict_size, act=SoftmaxActivation())
outputs(classification_cost(input=predict, label=data_layer(name="next", size=dict_size)))
