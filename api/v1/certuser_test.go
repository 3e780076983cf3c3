package v1

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCertificateUserIsThePeerAndTheKeysFingerprint(t *testing.T) {
	t.Parallel()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	der, err := x509.MarshalPKIXPublicKey(key.Public())
	require.NoError(t, err)
	sum := sha256.Sum256(der)

	user, err := CertificateUser("west", key.Public())
	require.NoError(t, err)
	// What `openssl pkey -pubout -outform DER | sha256sum | cut -c1-32` prints.
	require.Equal(t, "tokenbroker:west:"+hex.EncodeToString(sum[:])[:32], user)

	other, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	otherUser, err := CertificateUser("west", other.Public())
	require.NoError(t, err)
	require.NotEqual(t, user, otherUser, "one key, one user")
}
