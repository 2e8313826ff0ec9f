//! The files `envelope cuda-selftest` and its benchmarks write: JSON, and
//! CSV flushed a row at a time (so a run killed part-way, as a device
//! check's timeout does, leaves every row it finished).

use std::io;
use std::path::{Path, PathBuf};

/// Writes `v` as pretty JSON to `path`, creating its folder.
pub fn write_json(path: &Path, v: &impl serde::Serialize) -> io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(path, serde_json::to_string_pretty(v)?)
}

/// A CSV file written row by row through the csv crate (which quotes a
/// field holding a comma, quote or line break), each row flushed as it is
/// written.
pub struct CsvOut {
    path: PathBuf,
    w: csv::Writer<std::fs::File>,
    error: Option<csv::Error>,
}

impl CsvOut {
    /// Creates `path` (and its folder) with the `header` row.
    pub fn create(path: &Path, header: &[&str]) -> io::Result<Self> {
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)?;
        }
        let w = csv::Writer::from_path(path).map_err(io::Error::other)?;
        let mut out = CsvOut {
            path: path.to_path_buf(),
            w,
            error: None,
        };
        out.row(header);
        Ok(out)
    }

    /// Appends one row; the first write error is kept for `finish`.
    pub fn row<T: AsRef<[u8]>>(&mut self, fields: impl IntoIterator<Item = T>) {
        if self.error.is_none() {
            let written = self.w.write_record(fields);
            if let Err(e) = written.and_then(|()| self.w.flush().map_err(csv::Error::from)) {
                self.error = Some(e);
            }
        }
    }

    /// The first error any row met, naming the file.
    pub fn finish(self) -> io::Result<()> {
        match self.error {
            Some(e) => Err(io::Error::other(format!(
                "writing {}: {e}",
                self.path.display()
            ))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_rows_are_on_disk_as_soon_as_they_are_written() {
        let dir = std::env::temp_dir().join(format!("envelope-csvout-{}", std::process::id()));
        let path = dir.join("sub/points.csv");
        let mut csv = CsvOut::create(&path, &["a", "b"]).unwrap();
        csv.row(["1", "x, \"y\"\nz"]);
        let read = || -> Vec<Vec<String>> {
            csv::Reader::from_path(&path)
                .unwrap()
                .records()
                .map(|r| r.unwrap().iter().map(str::to_string).collect())
                .collect()
        };
        // Read before finish (as after a kill): the row is there, whole,
        // its comma, quotes and line break inside the one field.
        assert_eq!(read(), vec![vec!["1", "x, \"y\"\nz"]]);
        csv.row(["2", "w"]);
        csv.finish().unwrap();
        assert_eq!(read(), vec![vec!["1", "x, \"y\"\nz"], vec!["2", "w"]]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
