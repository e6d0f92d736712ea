//! Host matrix views: row-major with an explicit leading dimension (row stride).
//!
//! Element `(i, j)` of a view lives at `data[i * ld + j]`, with `ld >= cols`. Views carry
//! their shape so every function can check it; constructors validate that the slice is
//! long enough and return [`Error::Shape`] otherwise.

use crate::error::{Error, Result};

/// Immutable row-major view.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a, T> {
    data: &'a [T],
    rows: usize,
    cols: usize,
    ld: usize,
}

/// Mutable row-major view.
#[derive(Debug)]
pub struct MatMut<'a, T> {
    data: &'a mut [T],
    rows: usize,
    cols: usize,
    ld: usize,
}

fn required_len(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

fn check_view(rows: usize, cols: usize, ld: usize, len: usize) -> Result<()> {
    if ld < cols || len < required_len(rows, cols, ld) {
        return Err(Error::Shape {
            op: "MatRef::new",
            arg: "data",
            expected: format!(
                "at least {} elements with ld >= {cols}",
                required_len(rows, cols, ld.max(cols))
            ),
            got: format!("{len} elements with ld = {ld}"),
        });
    }
    Ok(())
}

/// The `rows`/`cols`/`shape` accessors every matrix type here (and
/// [`crate::device::Matrix`]) shares; the type needs `rows` and `cols` fields.
macro_rules! shape_accessors {
    () => {
        /// Number of rows.
        pub fn rows(&self) -> usize {
            self.rows
        }
        /// Number of columns.
        pub fn cols(&self) -> usize {
            self.cols
        }
        /// `(rows, cols)`.
        pub fn shape(&self) -> (usize, usize) {
            (self.rows, self.cols)
        }
    };
}
pub(crate) use shape_accessors;

/// Constructors and accessors shared by [`MatRef`] and [`MatMut`], which differ only in the
/// slice they borrow (`$slice`).
macro_rules! view_common {
    ($slice:ty) => {
        /// A contiguous `rows x cols` view (`ld = cols`).
        pub fn new(data: $slice, rows: usize, cols: usize) -> Result<Self> {
            Self::with_ld(data, rows, cols, cols)
        }
        /// A view with leading dimension `ld` (distance between rows, in elements).
        pub fn with_ld(data: $slice, rows: usize, cols: usize, ld: usize) -> Result<Self> {
            check_view(rows, cols, ld, data.len())?;
            Ok(Self {
                data,
                rows,
                cols,
                ld,
            })
        }
        shape_accessors!();
        /// Leading dimension (distance between rows, in elements).
        pub fn ld(&self) -> usize {
            self.ld
        }
    };
}

impl<'a, T> MatRef<'a, T> {
    view_common!(&'a [T]);
    /// The underlying slice (rows `ld` apart).
    pub fn data(&self) -> &'a [T] {
        self.data
    }
    /// Row `i` (length `cols`). Panics if `i >= rows`: internal use with checked indices.
    pub fn row(&self, i: usize) -> &'a [T] {
        &self.data[i * self.ld..i * self.ld + self.cols]
    }
}

impl<T: Copy> MatRef<'_, T> {
    /// Element `(i, j)`.
    pub fn at(&self, i: usize, j: usize) -> T {
        self.data[i * self.ld + j]
    }
}

impl<'a, T> MatMut<'a, T> {
    view_common!(&'a mut [T]);
    /// Reborrow as an immutable view.
    pub fn as_ref(&self) -> MatRef<'_, T> {
        MatRef {
            data: self.data,
            rows: self.rows,
            cols: self.cols,
            ld: self.ld,
        }
    }
    /// Reborrow mutably (for passing on without giving up the view).
    pub fn rb(&mut self) -> MatMut<'_, T> {
        MatMut {
            data: self.data,
            rows: self.rows,
            cols: self.cols,
            ld: self.ld,
        }
    }
    /// The underlying slice.
    pub fn data_mut(&mut self) -> &mut [T] {
        self.data
    }
    /// Row `i`, mutable.
    pub fn row_mut(&mut self, i: usize) -> &mut [T] {
        &mut self.data[i * self.ld..i * self.ld + self.cols]
    }
}

/// Owned contiguous row-major `f32`/`bf16` host matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Mat<T = f32> {
    data: Vec<T>,
    rows: usize,
    cols: usize,
}

impl<T: Copy + Default> Mat<T> {
    /// `rows x cols` of `T::default()` (zero).
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Self {
            data: vec![T::default(); rows * cols],
            rows,
            cols,
        }
    }
}

impl<T> Mat<T> {
    /// Takes ownership of `data` (row-major, `rows * cols` long).
    pub fn from_vec(data: Vec<T>, rows: usize, cols: usize) -> Result<Self> {
        crate::error::check_len("Mat::from_vec", "data", data.len(), rows * cols)?;
        Ok(Self { data, rows, cols })
    }
    shape_accessors!();
    pub fn as_slice(&self) -> &[T] {
        &self.data
    }
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.data
    }
    pub fn into_vec(self) -> Vec<T> {
        self.data
    }
    pub fn as_ref(&self) -> MatRef<'_, T> {
        MatRef {
            data: &self.data,
            rows: self.rows,
            cols: self.cols,
            ld: self.cols,
        }
    }
    pub fn as_mut(&mut self) -> MatMut<'_, T> {
        MatMut {
            data: &mut self.data,
            rows: self.rows,
            cols: self.cols,
            ld: self.cols,
        }
    }
}

impl Mat<f32> {
    /// The `n x n` identity.
    pub fn identity(n: usize) -> Self {
        let mut m = Self::zeros(n, n);
        for i in 0..n {
            m.data[i * n + i] = 1.0;
        }
        m
    }
}

/// Whether a GEMM operand is used as stored or transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Trans {
    /// Use the operand as stored.
    No,
    /// Use the operand's transpose.
    Yes,
}
