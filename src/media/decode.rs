//! Bytes → RGB pixels, with the conversions PIL applies in transformers' `convert_to_rgb`: an image
//! with an alpha channel (or GIF transparency) is composited onto white with PIL's integer
//! `alpha_composite`, grayscale is replicated into three channels, and a GIF's first frame is
//! used. Dimensions and allocation are bounded before any pixel is decoded.

use std::io::Cursor;

use image::{DynamicImage, ImageReader, Limits};

use super::MediaError;

/// An 8-bit RGB image, rows top to bottom, pixels interleaved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

impl RgbImage {
    pub fn new(width: u32, height: u32, data: Vec<u8>) -> Self {
        assert_eq!(data.len(), width as usize * height as usize * 3, "RGB data does not match its size");
        RgbImage { width, height, data }
    }
}

/// What one image may cost before it is decoded.
#[derive(Clone, Copy, Debug)]
pub struct DecodeLimits {
    /// Encoded bytes.
    pub max_bytes: usize,
    /// Decoded width × height.
    pub max_pixels: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits { max_bytes: 20 << 20, max_pixels: 50_000_000 }
    }
}

/// Decode PNG, JPEG, WebP or GIF (first frame) bytes into RGB as transformers' PIL path sees them.
pub fn decode_image(bytes: &[u8], limits: DecodeLimits) -> Result<RgbImage, MediaError> {
    if bytes.len() > limits.max_bytes {
        return Err(MediaError::TooManyBytes { bytes: bytes.len(), limit: limits.max_bytes });
    }
    let reader =
        ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| MediaError::Decode(e.to_string()))?;
    if reader.format().is_none() {
        return Err(MediaError::Decode("unknown format (PNG, JPEG, WebP and GIF are accepted)".into()));
    }
    let (width, height) = reader.into_dimensions().map_err(|e| MediaError::Decode(e.to_string()))?;
    if width as u64 * height as u64 > limits.max_pixels {
        return Err(MediaError::TooManyPixels { width, height, limit: limits.max_pixels });
    }
    let mut reader =
        ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| MediaError::Decode(e.to_string()))?;
    let mut l = Limits::default();
    l.max_image_width = Some(width);
    l.max_image_height = Some(height);
    l.max_alloc = Some(limits.max_pixels.saturating_mul(8).max(1 << 20));
    reader.limits(l);
    let img = reader.decode().map_err(|e| MediaError::Decode(e.to_string()))?;
    if img.width() == 0 || img.height() == 0 {
        return Err(MediaError::Decode("the image has no pixels".into()));
    }
    Ok(to_rgb(img))
}

fn to_rgb(img: DynamicImage) -> RgbImage {
    let (width, height) = (img.width(), img.height());
    if !img.color().has_alpha() {
        return RgbImage::new(width, height, img.into_rgb8().into_raw());
    }
    let rgba = img.into_rgba8().into_raw();
    let mut data = Vec::with_capacity(width as usize * height as usize * 3);
    for px in rgba.chunks_exact(4) {
        data.extend_from_slice(&composite_on_white([px[0], px[1], px[2]], px[3]));
    }
    RgbImage::new(width, height, data)
}

/// PIL's `alpha_composite(white, src)` then `convert("RGB")`: integer arithmetic with 7 extra
/// bits of precision and division by 255 as shift-and-add, rounded (Pillow's `AlphaComposite.c`).
pub fn composite_on_white(src: [u8; 3], alpha: u8) -> [u8; 3] {
    const PRECISION_BITS: u32 = 7;
    if alpha == 0 {
        return [255; 3];
    }
    let shift_div_255 = |a: u32| ((a >> 8) + a) >> 8;
    let a = alpha as u32;
    let blend = 255 * (255 - a);
    let outa255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / outa255;
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    src.map(|c| {
        let tmp = c as u32 * coef1 + 255 * coef2;
        (shift_div_255(tmp + (0x80 << PRECISION_BITS)) >> PRECISION_BITS) as u8
    })
}
