package pki

import (
	"bytes"
	"testing"
)

// The fuzz targets cover every parser of untrusted input. Regression inputs
// live in testdata/fuzz/<target>/ and run as part of `go test`.

func FuzzParseCertificatesPEM(f *testing.F) {
	ca, err := NewCA(CAOptions{Now: fixedNow})
	if err != nil {
		f.Fatal(err)
	}
	kp, err := ca.IssueClient(ClientOptions{Identity: "spiffe://oc.example/cluster/west"})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(ca.CertPEM())
	f.Add(append(append([]byte(nil), kp.CertPEM...), ca.CertPEM()...))
	f.Add(kp.KeyPEM)
	f.Add([]byte("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n"))
	f.Add([]byte("-----BEGIN CERTIFICATE-----\nProc-Type: 4,ENCRYPTED\n\nAAAA\n-----END CERTIFICATE-----\n"))
	f.Add(append(ca.CertPEM(), "trailing"...))
	f.Fuzz(func(t *testing.T, data []byte) {
		certs, err := ParseCertificatesPEM(data)
		if err != nil {
			if certs != nil {
				t.Fatal("certificates returned with an error")
			}
			return
		}
		if len(certs) == 0 || len(certs) > MaxCertificates {
			t.Fatalf("parsed %d certificates", len(certs))
		}
		// Re-encoding what was parsed parses to the same certificates.
		var again []byte
		for _, c := range certs {
			again = append(again, encodeCert(c.Raw)...)
			_ = Fingerprint(c)
			_, _ = IdentityFromCert(c)
		}
		round, err := ParseCertificatesPEM(again)
		if err != nil || len(round) != len(certs) {
			t.Fatalf("re-encoded certificates do not parse: %v", err)
		}
		for i := range certs {
			if !bytes.Equal(round[i].Raw, certs[i].Raw) {
				t.Fatalf("certificate %d changed in a round trip", i)
			}
		}
	})
}

func FuzzParsePrivateKeyPEM(f *testing.F) {
	ca, err := NewCA(CAOptions{Now: fixedNow})
	if err != nil {
		f.Fatal(err)
	}
	key, err := ca.KeyPEM()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(key)
	f.Add(ca.CertPEM())
	f.Add([]byte("-----BEGIN EC PARAMETERS-----\nBggqhkjOPQMBBw==\n-----END EC PARAMETERS-----\n"))
	f.Add([]byte("-----BEGIN RSA PRIVATE KEY-----\nMAA=\n-----END RSA PRIVATE KEY-----\n"))
	f.Add(append(append([]byte(nil), key...), key...))
	f.Fuzz(func(t *testing.T, data []byte) {
		signer, err := ParsePrivateKeyPEM(data)
		if err != nil {
			if signer != nil {
				t.Fatal("key returned with an error")
			}
			return
		}
		if signer.Public() == nil {
			t.Fatal("parsed key has no public key")
		}
		if _, err := encodeKey(signer); err != nil {
			t.Fatalf("parsed key does not marshal: %v", err)
		}
	})
}

func FuzzParseIdentity(f *testing.F) {
	for _, s := range []string{
		"spiffe://oc.example/cluster/west",
		"spiffe://local/cluster/a",
		"spiffe://oc.example/cluster/west/",
		"spiffe://oc.example:443/cluster/west",
		"spiffe://user@oc.example/cluster/west",
		"spiffe://oc.example/cluster/w%65st",
		"SPIFFE://OC.EXAMPLE/cluster/west",
		"spiffe:///cluster/",
		"",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		td, cluster, err := ParseIdentity(id)
		if err != nil {
			return
		}
		// Exactly one spelling per identity: parsing and building agree.
		built, err := ClusterIdentity(td, cluster)
		if err != nil {
			t.Fatalf("ParseIdentity accepted %q but ClusterIdentity(%q, %q) refused: %v", id, td, cluster, err)
		}
		if built != id {
			t.Fatalf("ParseIdentity(%q) round-trips to %q", id, built)
		}
	})
}
