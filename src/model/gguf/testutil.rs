//! Building GGUF files in memory for tests.

#[derive(Default)]
pub struct GgufBuilder {
    pub version: u32,
    kv: Vec<(String, u32, Vec<u8>)>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    pub alignment: usize,
}

pub fn str_bytes(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

/// Payload of an array value: element type, count, then the elements' bytes.
pub fn array_payload(elem_ty: u32, count: usize, elems: &[u8]) -> Vec<u8> {
    let mut v = elem_ty.to_le_bytes().to_vec();
    v.extend_from_slice(&(count as u64).to_le_bytes());
    v.extend_from_slice(elems);
    v
}

impl GgufBuilder {
    pub fn new() -> Self {
        GgufBuilder { version: 3, alignment: 32, ..Default::default() }
    }
    pub fn raw(&mut self, key: &str, ty: u32, payload: Vec<u8>) -> &mut Self {
        self.kv.push((key.to_string(), ty, payload));
        self
    }
    pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.raw(key, 4, v.to_le_bytes().to_vec())
    }
    pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.raw(key, 6, v.to_le_bytes().to_vec())
    }
    pub fn bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.raw(key, 7, vec![v as u8])
    }
    pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
        self.raw(key, 8, str_bytes(v))
    }
    pub fn str_array(&mut self, key: &str, v: &[&str]) -> &mut Self {
        let elems: Vec<u8> = v.iter().flat_map(|s| str_bytes(s)).collect();
        self.raw(key, 9, array_payload(8, v.len(), &elems))
    }
    pub fn i32_array(&mut self, key: &str, v: &[i32]) -> &mut Self {
        let elems: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.raw(key, 9, array_payload(5, v.len(), &elems))
    }
    /// A tensor with row-major `shape` (written reversed, as GGUF's `ne`).
    pub fn tensor(&mut self, name: &str, shape: &[usize], ggml_type: u32, data: Vec<u8>) -> &mut Self {
        let ne = shape.iter().rev().map(|&d| d as u64).collect();
        self.tensors.push((name.to_string(), ne, ggml_type, data));
        self
    }
    pub fn f32_tensor(&mut self, name: &str, shape: &[usize], values: &[f32]) -> &mut Self {
        self.tensor(name, shape, 0, values.iter().flat_map(|x| x.to_le_bytes()).collect())
    }

    pub fn bytes(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (k, ty, payload) in &self.kv {
            out.extend(str_bytes(k));
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(payload);
        }
        let align = |n: usize| n.div_ceil(self.alignment) * self.alignment;
        let mut rel = 0usize;
        let mut offsets = Vec::new();
        for (name, ne, ty, data) in &self.tensors {
            out.extend(str_bytes(name));
            out.extend_from_slice(&(ne.len() as u32).to_le_bytes());
            for d in ne {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&(rel as u64).to_le_bytes());
            offsets.push(rel);
            rel = align(rel + data.len());
        }
        let data_start = align(out.len());
        out.resize(data_start, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend_from_slice(data);
        }
        out
    }

    pub fn write(&self, dir: &std::path::Path, name: &str) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.bytes()).expect("write test gguf");
        p
    }
}
