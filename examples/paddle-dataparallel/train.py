"""A plain PaddlePaddle collective (DataParallel) script: nothing fabtrain-specific.

fabtrain gives each process PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM,
PADDLE_TRAINER_ENDPOINTS and PADDLE_CURRENT_ENDPOINT, which is what
`paddle.distributed.launch` would set; init_parallel_env() reads them.
"""
import paddle
import paddle.distributed as dist


def main() -> None:
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    paddle.seed(rank)
    model = paddle.DataParallel(paddle.nn.Linear(16, 1))
    opt = paddle.optimizer.SGD(learning_rate=0.05, parameters=model.parameters())
    for step in range(50):
        x = paddle.randn([32, 16])
        loss = paddle.nn.functional.mse_loss(model(x), x.sum(axis=1, keepdim=True))
        loss.backward()
        opt.step()
        opt.clear_grad()
    total = paddle.to_tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"rank {rank}: loss {float(loss):.4f} all_reduce sum {float(total):g} world {world}", flush=True)


if __name__ == "__main__":
    main()
