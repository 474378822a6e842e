//! Every kind of input a unit can replay: a slice of tape values, `Copy` configuration
//! (`usize`, `f64`, a user enum) and `&Packing`.

use candle_core::{Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Packing, Plan, Result, Var};

#[derive(Clone, Copy, Debug)]
enum Mix {
    Sum,
    Mean,
}

/// Mixes `xs`, scales by `gain`, keeps the first `keep` tokens of the packed batch.
#[recovery_unit(cost = xs.len() * keep, deterministic)]
fn mix(
    cx: &mut Cx,
    xs: &[Var],
    keep: usize,
    gain: f64,
    how: Mix,
    packing: &Packing,
) -> Result<Var> {
    assert!(keep <= packing.total_tokens());
    let mut acc = xs[0].clone();
    for x in &xs[1..] {
        acc = cx.add(&acc, x)?;
    }
    let acc = match how {
        Mix::Sum => acc,
        Mix::Mean => cx.scale(&acc, 1.0 / xs.len() as f64)?,
    };
    let acc = cx.mul(&acc, &acc)?;
    let acc = cx.scale(&acc, gain)?;
    cx.narrow(&acc, 0, 0, keep)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

fn run(xs: &[Var], how: Mix, packing: &Packing, plan: Plan) -> Result<Vec<u32>> {
    let mut cx = Cx::new(plan);
    let y = mix(&mut cx, xs, 3, 0.5, how, packing)?;
    assert_eq!(y.dims(), &[3, 4]);
    let mut grads = Grads::new();
    let seed = Tensor::ones(y.dims(), y.dtype(), y.device())?;
    cx.backward(&y, &seed, &mut grads)?;
    assert_eq!(cx.memory().live_bytes(), 0);
    let mut out = Vec::new();
    for x in xs {
        out.extend(bits(
            grads.get(x.id()).expect("every input has a gradient"),
        )?);
    }
    Ok(out)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let packing = Packing::new(&[3, 2], &dev)?;
    let xs: Vec<Var> = (0..3)
        .map(|_| Ok(Var::param(Tensor::randn(0f32, 1.0, (5, 4), &dev)?)))
        .collect::<Result<_>>()?;
    for how in [Mix::Sum, Mix::Mean] {
        let stored = run(&xs, how, &packing, Plan::store_all())?;
        let recomputed = run(
            &xs,
            how,
            &packing,
            Plan::store_all().with_unit("mix", Fidelity::Recompute),
        )?;
        assert_eq!(stored, recomputed, "{how:?}");
    }
    Ok(())
}
