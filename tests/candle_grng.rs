//! grng inside candle (feature `candle`): zero-copy views, captured Kronecker statistics
//! against the reference MLP, optimizer steps against grng's own API, and bad input.
#![cfg(feature = "candle")]

use candle_core::{DType, Device as CDevice, Tensor};
use grng::candle::{with_matrices, with_matrix, ViewAs};
use grng::{Device, Error};
use proptest::prelude::*;

/// Address of a CPU f32 tensor's buffer.
fn buffer_addr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    match &*s {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.as_ptr() as usize,
        _ => panic!("not a CPU f32 tensor"),
    }
}

fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn tensor(vals: &[f32], rows: usize, cols: usize) -> Tensor {
    Tensor::from_slice(vals, (rows, cols), &CDevice::Cpu).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A view is the tensor's own buffer (same pointer), shaped as the tensor; what grng writes
    /// is what the tensor holds afterwards, and the buffer a matrix ends with is moved (same
    /// pointer) into its tensor: grng's ops commit by swapping in the buffer they computed.
    #[test]
    fn views_are_zero_copy(rows in 1usize..40, cols in 1usize..40, seed in any::<u64>()) {
        let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(seed);
        let x: Vec<f32> = (0..rows * cols).map(|_| rand::Rng::random_range(&mut rng, -1.0f32..1.0)).collect();
        let y: Vec<f32> = (0..rows * cols).map(|_| rand::Rng::random_range(&mut rng, -1.0f32..1.0)).collect();
        let (tx, ty) = (tensor(&x, rows, cols), tensor(&y, rows, cols));
        let (px, py) = (buffer_addr(&tx), buffer_addr(&ty));
        let seen = with_matrices(&[&ty, &tx], ViewAs::Matrix, |ms| {
            let (dst, src) = ms.split_at_mut(1);
            let ptrs = (dst[0].host().unwrap().as_ptr() as usize, src[0].host().unwrap().as_ptr() as usize);
            let shapes = (dst[0].shape(), src[0].shape());
            Device::Cpu.axpy(0.5, &src[0], &mut dst[0])?; // y ← y + x/2
            Ok((ptrs, shapes, dst[0].host().unwrap().as_ptr() as usize))
        }).unwrap();
        prop_assert_eq!(seen.0, (py, px));
        prop_assert_eq!(seen.1, ((rows, cols), (rows, cols)));
        prop_assert_eq!(buffer_addr(&tx), px);
        prop_assert_eq!(buffer_addr(&ty), seen.2);
        prop_assert_eq!(host(&tx), x.clone());
        // axpy rounds once per element: f32 `y + 0.5 x` exactly as computed here.
        let want: Vec<f32> = y.iter().zip(&x).map(|(y, x)| y + 0.5 * x).collect();
        prop_assert_eq!(host(&ty), want);
        let col = with_matrix(&tx, ViewAs::Column, |m| Ok(m.shape())).unwrap();
        prop_assert_eq!(col, (rows * cols, 1));
    }
}

fn assert_tensor_error<T: std::fmt::Debug>(r: grng::Result<T>) {
    assert!(matches!(r, Err(Error::Tensor { .. })), "{r:?}");
}

/// dtype, strides, offsets, partial storages, ranks, aliasing and failing closures are typed
/// errors, and the tensors keep their values.
#[test]
fn bad_views_are_typed_errors_and_change_nothing() {
    let vals: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let t = tensor(&vals, 3, 4);
    let never = |_: &mut grng::Matrix| -> grng::Result<()> { panic!("must not be lent") };
    assert_tensor_error(with_matrix(
        &t.to_dtype(DType::F64).unwrap(),
        ViewAs::Matrix,
        never,
    ));
    assert_tensor_error(with_matrix(&t.t().unwrap(), ViewAs::Matrix, never));
    assert_tensor_error(with_matrix(
        &t.narrow(0, 1, 2).unwrap(),
        ViewAs::Matrix,
        never,
    ));
    assert_tensor_error(with_matrix(
        &t.narrow(0, 0, 2).unwrap(),
        ViewAs::Matrix,
        never,
    ));
    assert_tensor_error(with_matrices(&[&t, &t.clone()], ViewAs::Matrix, |_| Ok(())));
    let r3 = t.reshape((3, 2, 2)).unwrap();
    assert!(matches!(
        with_matrix(&r3, ViewAs::Matrix, never),
        Err(Error::Shape { .. })
    ));
    assert_eq!(
        with_matrix(&r3, ViewAs::Column, |m| Ok(m.shape())).unwrap(),
        (12, 1)
    );
    let empty = Tensor::zeros((0, 3), DType::F32, &CDevice::Cpu).unwrap();
    assert!(matches!(
        with_matrix(&empty, ViewAs::Matrix, never),
        Err(Error::Shape { .. })
    ));
    // A grng error inside the view: propagated, the tensor as it was.
    let other = Device::Cpu.zeros(4, 3).unwrap();
    let r = with_matrix(&t, ViewAs::Matrix, |m| Device::Cpu.axpy(1.0, &other, m));
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    // A closure that swaps in a matrix of another shape: an error, the tensor stays valid.
    let r = with_matrix(&t, ViewAs::Matrix, |m| {
        *m = Device::Cpu.zeros(2, 2)?;
        Ok(())
    });
    assert!(matches!(r, Err(Error::Shape { .. })), "{r:?}");
    assert_eq!(host(&t).len(), 12);
}
